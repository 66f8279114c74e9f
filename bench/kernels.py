"""Check, then time, the Triton NSA kernels on one GPU, against dense attention and fla-core, in one run.

    python bench/kernels.py --out DIR [--quick]

1. Correctness in bf16 against a float64 reference computed on the GPU in query chunks (outputs, all eight input
   gradients, selected block sets; selection differences are excused only at detected near-ties, and counted).
2. Timing (median of triton.testing.do_bench) of fwd+bwd of our full NSA (compressed attention, selection,
   selected attention, window, gates) and of each piece, next to dense SDPA (cuDNN and flash backends, K/V
   repeated to all heads) and fla-core's parallel_nsa where it applies, with peak memory, at the paper and the
   125M-class configurations of ../shared/ANCHORS.md.
Writes DIR/kernels-<device>-<date>.json and .md; prints the table last.

fla-core is timed when it imports; the GPU image lacks it. Its wheel is pure Python: `pip download --no-deps
fla-core==0.6.0 einops -d .whl_fla` here, carry `.whl_fla` to the GPU machine and there `pip install --no-index
--no-deps --target /tmp/site .whl_fla/*.whl` with /tmp/site on PYTHONPATH (kernels-notes.md v37).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nsa_model.config import NSAConfig  # noqa: E402
from bench.launch import launch_overrides  # noqa: E402
from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402
from bench.shapes import PAPER_NSA, family_shapes  # noqa: E402
from nsa_model.ops import triton_impl as ti  # noqa: E402

NAMES = ("q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates")
BF16_TOL = 1e-2
NEAR_TIE_REL = 1e-3  # kernel importance is fp32 from exact bf16 products: its error is far below this

# Targets of the brief: our fwd+bwd / dense cuDNN fwd+bwd, same run.
TARGETS = {("paper", 1, 8192): 0.9, ("paper", 1, 65536): 0.18, ("125m", 16, 2048): 2.5, ("125m", 4, 8192): 1.0,
           ("125m", 1, 32768): 0.45}
SHAPES = {"paper": dict(H=64, G=4, Dk=128, Dv=128), "125m": dict(H=12, G=2, Dk=64, Dv=64)}


def make_inputs(B, T, H, G, Dk, Dv, cfg, dtype, seed, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    tc = cfg.num_cmp_tokens(T)
    shapes = {"q": (B, T, H, Dk), "k_slc": (B, T, G, Dk), "v_slc": (B, T, G, Dv), "k_win": (B, T, G, Dk),
              "v_win": (B, T, G, Dv), "k_cmp": (B, tc, G, Dk), "v_cmp": (B, tc, G, Dv)}
    x = {n: torch.randn(*s, generator=gen, device=device, dtype=torch.float32).to(dtype) for n, s in shapes.items()}
    x["gates"] = torch.rand(B, T, H, 3, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return x


# --- float64 reference, chunked over queries -----------------------------------------------------------------

def block_importance(p_group, T, cfg):
    """imp[..., j] = sum_i p[..., i] * W[i, j] (spec section 3) via pieces: piece k (d tokens) gets the mass of
    every compressed token that covers it, and a block sums its pieces."""
    L, K = cfg.cmp_block // cfg.cmp_stride, cfg.sel_block // cfg.cmp_stride
    nb = cfg.num_sel_blocks(T)
    tc = p_group.shape[-1]
    padded = F.pad(p_group, (L - 1, nb * K - tc))
    pieces = sum(padded[..., L - 1 - m: L - 1 - m + nb * K] for m in range(L))
    return pieces.unflatten(-1, (nb, K)).sum(-1)


def reference_chunk(x, t0, t1, blocks, cfg, scale):
    """o [B, C, H, Dv] in float64 for queries t0..t1-1 (selected branch over the kernel's blocks), and the
    reference selection keys [B, C, G, NB] (importance, +inf forced, -inf not a candidate)."""
    q = x["q"][:, t0:t1]
    B, C, H, Dk = q.shape
    T, G, Dv = x["k_slc"].shape[1], x["k_slc"].shape[2], x["v_slc"].shape[-1]
    h = H // G
    qg = q.view(B, C, G, h, Dk)
    dev = q.device
    t = torch.arange(t0, t1, device=dev)

    # compressed branch
    tc = x["k_cmp"].shape[1]
    n_vis = torch.where(t + 1 >= cfg.cmp_block, (t + 1 - cfg.cmp_block) // cfg.cmp_stride + 1, 0)
    vis = torch.arange(tc, device=dev)[None, :] < n_vis[:, None]
    s = torch.einsum("bcghd,bigd->bcghi", qg, x["k_cmp"]) * scale
    s = s.masked_fill(~vis[None, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(vis[None, :, None, None, :], torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)), 0.0)
    o_cmp = torch.einsum("bcghi,bigd->bcghd", p, x["v_cmp"])

    imp = block_importance(p.detach().sum(3), T, cfg)  # [B, C, G, NB]
    nb = imp.shape[-1]
    j = torch.arange(nb, device=dev)
    cand = (j[None, :] * cfg.sel_block) <= t[:, None]
    cur = (t // cfg.sel_block)[:, None]
    forced = cand & ((j[None, :] < cfg.n_init_blocks) | (j[None, :] > cur - cfg.n_local_blocks))
    keys = imp.masked_fill(forced[None, :, None, :], float("inf")).masked_fill(~cand[None, :, None, :],
                                                                            float("-inf"))

    # selected branch over the given blocks
    S = blocks.shape[-1] * cfg.sel_block
    pos = blocks.long()[..., None] * cfg.sel_block + torch.arange(cfg.sel_block, device=dev)
    valid = (blocks >= 0)[..., None] & (pos <= t[None, :, None, None, None])
    pos = pos.clamp(0, T - 1).flatten(3)  # [B, C, G, S]
    valid = valid.flatten(3)
    idx = pos.permute(0, 2, 1, 3).reshape(B, G, C * S, 1)
    ks = x["k_slc"].permute(0, 2, 1, 3).gather(2, idx.expand(-1, -1, -1, Dk)).view(B, G, C, S, Dk)
    vs = x["v_slc"].permute(0, 2, 1, 3).gather(2, idx.expand(-1, -1, -1, Dv)).view(B, G, C, S, Dv)
    s = torch.einsum("bcghd,bgcsd->bcghs", qg, ks) * scale
    s = s.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    o_slc = torch.einsum("bcghs,bgcsd->bcghd", torch.softmax(s, -1), vs)

    # window branch
    lo = max(0, t0 - cfg.window + 1)
    u = torch.arange(lo, t1, device=dev)
    vis_w = (u[None, :] <= t[:, None]) & (u[None, :] > t[:, None] - cfg.window)
    s = torch.einsum("bcghd,bugd->bcghu", qg, x["k_win"][:, lo:t1]) * scale
    s = s.masked_fill(~vis_w[None, :, None, None, :], float("-inf"))
    o_win = torch.einsum("bcghu,bugd->bcghd", torch.softmax(s, -1), x["v_win"][:, lo:t1])

    g = x["gates"][:, t0:t1]
    o = (g[..., 0:1] * o_cmp.reshape(B, C, H, Dv) + g[..., 1:2] * o_slc.reshape(B, C, H, Dv)
         + g[..., 2:3] * o_win.reshape(B, C, H, Dv))
    return o, keys


def selection_agreement(keys, blocks):
    """(rows that differ, of which near-ties, largest relative gap) between the kernel's and the reference's sets."""
    n = blocks.shape[-1]
    chosen = (blocks >= 0).to(torch.int32)
    kernel = torch.zeros(keys.shape, dtype=torch.int32, device=keys.device)
    kernel = kernel.scatter_add_(-1, blocks.long().clamp_min(0), chosen) > 0
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices[..., :n]
    ref = torch.zeros_like(kernel).scatter_(-1, order, True) & (keys > float("-inf"))
    kernel_only, ref_only = kernel & ~ref, ref & ~kernel
    differs = kernel_only.any(-1) | ref_only.any(-1)
    # A near-tie swaps blocks of (almost) equal reference importance; a missing or extra block is never one.
    swapped = kernel_only.sum(-1) == ref_only.sum(-1)
    weakest_kernel = torch.where(kernel_only, keys, float("inf")).amin(-1)
    strongest_ref = torch.where(ref_only, keys, float("-inf")).amax(-1)
    gap = (strongest_ref - weakest_kernel) / strongest_ref.abs().clamp_min(1e-12)
    gap = torch.where(differs, torch.where(swapped, gap, float("inf")), 0.0).nan_to_num(nan=float("inf"))
    near = differs & (gap <= NEAR_TIE_REL)
    return int(differs.sum()), int(near.sum()), float(gap.max()) if gap.numel() else 0.0


def check_bf16(name, B, T, H, G, Dk, Dv, cfg, grads=True, seed=0, stacked_kv=False, query_ranges=None):
    """One bf16 case against the float64 chunked reference; returns a dict of errors. stacked_kv: the slc and win
    K/V sets are slices of one [B, T, 3, G, D] tensor, as NSAAttention passes them (the kernels read them in
    place, tokens 3 * G * D apart). query_ranges: ((t0, t1), ..) the queries checked, where the reference of
    every query would take too long (paper shapes at T = 128k). The kernels still run the whole sequence; the
    output gradient is zero outside the ranges, so every input gradient is exactly the ranges' own, and the
    reference runs their chunks only."""
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, torch.bfloat16, seed)
    ranges = [(0, T)] if query_ranges is None else sorted(query_ranges)
    if not all(0 <= t0 < t1 <= T for t0, t1 in ranges) or any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"{name}: query_ranges {ranges} must be disjoint ranges inside [0, {T})")
    scale = Dk ** -0.5
    xin = {n: t.clone().requires_grad_(grads) for n, t in x.items()}
    if stacked_kv:
        stacked = {kv: torch.stack([torch.zeros_like(x[f"{kv}_slc"]), x[f"{kv}_slc"], x[f"{kv}_win"]], dim=2)
                   .requires_grad_(grads) for kv in ("k", "v")}
        for kv in ("k", "v"):
            _, xin[f"{kv}_slc"], xin[f"{kv}_win"] = stacked[kv].unbind(2)
    o, blocks = ti.nsa_attention(*xin.values(), cfg, scale=scale, return_blocks=True)
    do = torch.randn_like(o)
    checked = torch.zeros(T, dtype=torch.bool, device=o.device)
    for t0, t1 in ranges:
        checked[t0:t1] = True
    do = do * checked[None, :, None, None]
    if grads:
        o.backward(do)
        got = {n: xin[n].grad for n in NAMES if xin[n].is_leaf}
        if stacked_kv:
            got.update({f"{kv}_{branch}": stacked[kv].grad[:, :, i] for kv in ("k", "v")
                        for i, branch in ((1, "slc"), (2, "win"))})
    x64 = {n: t.double().requires_grad_(grads) for n, t in x.items()}
    o_ref = torch.empty(o.shape, dtype=torch.float64, device=o.device)
    per_query = G * cfg.n_selected * cfg.sel_block * (Dk + Dv) * 8 * 4 + H * max(1, x["k_cmp"].shape[1]) * 8 * 4
    chunk = max(16, min(1024, 2 ** int(math.log2(max(1, (1 << 30) // per_query)))))
    diff = near = 0
    max_gap = 0.0
    for t0, t1 in ((c, min(r1, c + chunk)) for r0, r1 in ranges for c in range(r0, r1, chunk)):
        with torch.set_grad_enabled(grads):
            o_c, keys = reference_chunk(x64, t0, t1, blocks[:, t0:t1], cfg, scale)
            if grads:
                (o_c * do[:, t0:t1].double()).sum().backward()
        o_ref[:, t0:t1] = o_c.detach()
        d, nr, g = selection_agreement(keys, blocks[:, t0:t1])
        diff, near, max_gap = diff + d, near + nr, max(max_gap, g if d else 0.0)

    def rel(a, b):
        # absolute where the reference is (nearly) zero: e.g. q and k gradients of a one-key softmax at T = 1
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp_min(1.0))

    result = {"case": name, "B": B, "T": T, "H": H, "G": G, "Dk": Dk, "Dv": Dv, "nsa": dataclasses.asdict(cfg),
              "o": rel(o[:, checked], o_ref[:, checked]), "queries_checked": int(checked.sum()),
              "selection_rows_differing": diff, "selection_near_ties": near, "selection_max_rel_gap": max_gap,
              "finite": bool(torch.isfinite(o).all())}
    if grads:
        for n in NAMES:
            result["d" + n] = rel(got[n], x64[n].grad)
            result["finite"] &= bool(torch.isfinite(got[n]).all())
    errors = [v for k, v in result.items() if k in ("o",) or (k.startswith("d") and k[1:] in NAMES)]
    result["ok"] = (result["finite"] and max(errors) <= BF16_TOL and diff == near)
    return result


CHECKS = [
    dict(name="125m_T64k", B=1, T=65536, H=12, G=2, Dk=64, Dv=64),
    dict(name="125m_T128k", B=1, T=131072, H=12, G=2, Dk=64, Dv=64),  # the longest T issue 4 names for one GPU
    dict(name="125m_b4_T2k", B=4, T=2048, H=12, G=2, Dk=64, Dv=64),  # the training shape: tiled_by_block
    # the same, and by_block with a batch, with the K/V sets laid out as the model passes them
    dict(name="125m_b4_T2k_stacked_kv", B=4, T=2048, H=12, G=2, Dk=64, Dv=64, stacked_kv=True),
    dict(name="h8_b2_stacked_kv", B=2, T=3001, H=16, G=2, Dk=64, Dv=64, stacked_kv=True),
    dict(name="paper_T8k", B=1, T=8192, H=64, G=4, Dk=128, Dv=128),
    dict(name="paper_T32k_fwd", B=1, T=32768, H=64, G=4, Dk=128, Dv=128, grads=False),
    # the paper shapes at the longest T, every gradient, on the queries of three ranges (the reference of all 128k
    # would take minutes): the first, around T/2 and the last, where by_block's stored ds lies past 2^32 elements
    dict(name="paper_T128k_sampled", B=1, T=131072, H=64, G=4, Dk=128, Dv=128,
         query_ranges=((0, 1024), (65024, 66048), (130048, 131072))),
    # past 16n blocks (257 of 64): the per-query forward and dQ with by_block's dK/dV, the paper 64k row's kernels,
    # with grads
    dict(name="paper_T16k_per_query", B=1, T=16448, H=64, G=4, Dk=128, Dv=128),
    dict(name="h1_dk192_dv128", B=1, T=4133, H=4, G=4, Dk=192, Dv=128),
    dict(name="h8_b2", B=2, T=3001, H=16, G=2, Dk=64, Dv=64),
    dict(name="h16_T5000", B=1, T=5000, H=16, G=1, Dk=128, Dv=128),
    dict(name="h2_T1", B=1, T=1, H=4, G=2, Dk=64, Dv=64),
    dict(name="h2_T100", B=3, T=100, H=4, G=2, Dk=64, Dv=64),
    # NSA settings a Tune sweep picks (pipeline/tune.py varies l', n, and l, d, w), each reaching one selected variant
    # at a block count and n_pad the paper settings never give: `nsa` holds the fields that differ from PAPER_NSA
    dict(name="tiny_b2_T3001", B=2, T=3001, H=4, G=2, Dk=64, Dv=64,  # the tiny preset's own settings: by_block
         nsa=dict(cmp_block=16, cmp_stride=8, sel_block=16, n_selected=4, window=64)),
    dict(name="125m_T16k_sel32_n32", B=1, T=16384, H=12, G=2, Dk=64, Dv=64,  # by_block, n_pad 32
         nsa=dict(sel_block=32, n_selected=32)),
    dict(name="125m_b2_T2000_sel128_n8_cmp64", B=2, T=2000, H=12, G=2, Dk=64, Dv=64,  # tiled_by_block
         nsa=dict(cmp_block=64, cmp_stride=32, sel_block=128, n_selected=8, window=256)),
    # l' / d = 3: the selection's importance by its matmul, not the banded sums; n = 6 padded to 8; w not a power of 2
    dict(name="h8_T5000_sel48_n6", B=1, T=5000, H=16, G=2, Dk=64, Dv=64,
         nsa=dict(sel_block=48, n_selected=6, window=1000)),
    dict(name="paper_T8k_sel128_n8", B=1, T=8192, H=64, G=4, Dk=128, Dv=128,  # tiled
         nsa=dict(sel_block=128, n_selected=8)),
    dict(name="paper_T8k_sel32_n8_per_query", B=1, T=8192, H=64, G=4, Dk=128, Dv=128,  # per_query, n_pad 8
         nsa=dict(sel_block=32, n_selected=8)),
    dict(name="paper_T16k_sel32_n32_per_query", B=1, T=16448, H=64, G=4, Dk=128, Dv=128,  # per_query, n_pad 32
         nsa=dict(sel_block=32, n_selected=32)),
]


def check_case(case: dict) -> tuple[str, NSAConfig, dict]:
    """(name, NSA settings, check_bf16's other arguments) of a CHECKS entry: its `nsa` fields over PAPER_NSA."""
    case = dict(case)
    name = case.pop("name")
    return name, dataclasses.replace(PAPER_NSA, **case.pop("nsa", {})), case


# --- timing ---------------------------------------------------------------------------------------------------

def bench(fn, grads=()):
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads), return_mode="median")


def bench_graph(fn, grads=()):
    """Median ms of fn captured once as a CUDA graph and replayed: the GPU time without the host's launch cost,
    as training under CUDA graphs (compile_mode reduce-overhead) runs the NSA core. The leaves' .grad is reset
    to None before each call inside the graph (grad_to_none), as in the eager timing: accumulating into an
    existing .grad adds an elementwise pass per input that is no part of attention, and a larger one for dense,
    whose K/V are repeated to every head (v25: about 0.10 ms of NSA's 3.86 at 125m 4 x 8k and 0.13 of cuDNN's
    3.70; 0.18 and 0.38 at paper 8k)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, grad_to_none=list(grads) or None, return_mode="median")


def fresh_grads(fn, leaves):
    """fn with the leaves' gradients reset to None first: what the profiled pieces time, as the timings do."""
    def call():
        for t in leaves:
            t.grad = None
        fn()
    return call


def peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def dense_call(x, do, hpg: int, backend: str):
    """(fwd+bwd, leaves) of dense causal SDPA on backend "cudnn" or "flash" over the NSA inputs x's q and window
    K/V, the K/V repeated to all heads (hpg a group), [B, H, T, D] as SDPA's documentation takes them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd = x["q"].detach().transpose(1, 2).contiguous().requires_grad_()
    kd = x["k_win"].detach().repeat_interleave(hpg, dim=2).transpose(1, 2).contiguous().requires_grad_()
    vd = x["v_win"].detach().repeat_interleave(hpg, dim=2).transpose(1, 2).contiguous().requires_grad_()
    dod = do.transpose(1, 2).contiguous()
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def dense_fb():
        with sdpa_kernel(chosen):
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dod)
    return dense_fb, [qd, kd, vd]


SECTIONS = ("selected", "range", "profile")  # optional parts of each timing row (--sections)


def time_config(family, B, T, cfg, have_fla, sections=SECTIONS):
    s = SHAPES[family]
    H, G, Dk, Dv = s["H"], s["G"], s["Dk"], s["Dv"]
    scale = Dk ** -0.5
    x = {n: t.requires_grad_() for n, t in make_inputs(B, T, H, G, Dk, Dv, cfg, torch.bfloat16, seed=1).items()}
    leaves = list(x.values())
    do = torch.randn(B, T, H, Dv, device="cuda", dtype=torch.bfloat16)
    row = {"family": family, "B": B, "T": T}

    def nsa_fb():
        ti.nsa_attention(*leaves, cfg, scale=scale).backward(do)

    def nsa_f():
        with torch.no_grad():
            ti.nsa_attention(*leaves, cfg, scale=scale)

    with torch.no_grad():
        _, lse = ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)
        blocks = ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale)
    pieces = {
        "cmp_fb": lambda: ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)[0].backward(do),
        "select_f": lambda: ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale),
        "slc_fb": lambda: ti.selected_attention(x["q"], x["k_slc"], x["v_slc"], blocks, cfg, scale).backward(do),
        "win_fb": lambda: ti.window_attention(x["q"], x["k_win"], x["v_win"], cfg.window, scale).backward(do),
    }
    row["nsa_fb_ms"] = bench(nsa_fb, leaves)
    try:
        row["nsa_fb_graph_ms"] = bench_graph(nsa_fb, leaves)
    except Exception as e:  # recorded; the eager timings stand on their own
        traceback.print_exc()
        row["nsa_graph_error"] = repr(e)[:300]
    row["nsa_f_ms"] = bench(nsa_f)
    row["nsa_fb_peak_mib"] = peak_mib(nsa_fb)
    for name, fn in pieces.items():
        row[name + "_ms"] = bench(fn, leaves)
        # the eager wall time above is launch-bound at small shapes; this is what the GPU spends on the piece
        row[name + "_gpu_ms"] = gpu_kernel_ms(fresh_grads(fn, leaves))
    if "selected" in sections:
        try:
            row.update(time_selected_variants(x, blocks, do, cfg, scale, nsa_fb, leaves))
        except Exception as e:  # reported in the row; the main timings above stay
            traceback.print_exc()
            row["variants_error"] = repr(e)[:300]
    if "range" in sections:
        row.update(time_range_variants(pieces, nsa_fb, leaves))
    if "profile" in sections:
        row["kernel_ms"] = kernel_breakdown(fresh_grads(nsa_fb, leaves))

    for label in ("cudnn", "flash"):
        dense_fb, dense_leaves = dense_call(x, do, H // G, label)
        try:
            row[f"dense_{label}_fb_ms"] = bench(dense_fb, dense_leaves)
            row[f"dense_{label}_fb_peak_mib"] = peak_mib(dense_fb)
            if label == "cudnn":
                row["dense_cudnn_fb_graph_ms"] = bench_graph(dense_fb, dense_leaves)
        except Exception as e:  # a backend the build lacks is reported, not hidden
            row[f"dense_{label}_error"] = repr(e)[:300]

    hpg = H // G
    if have_fla and hpg >= 16 and hpg & (hpg - 1) == 0:
        from fla.ops.nsa import parallel_nsa
        k = x["k_slc"].detach().requires_grad_()
        v = x["v_slc"].detach().requires_grad_()
        qf = x["q"].detach().requires_grad_()
        g_cmp = x["gates"][..., 0].detach().contiguous().requires_grad_()
        g_slc = x["gates"][..., 1].detach().contiguous().requires_grad_()

        def fla_fb():
            parallel_nsa(qf, k, v, g_cmp, g_slc, None, block_counts=cfg.n_selected, block_size=cfg.sel_block,
                         window_size=0).backward(do)
        try:
            row["fla_fb_ms"] = bench(fla_fb, [qf, k, v, g_cmp, g_slc])
            row["fla_fb_peak_mib"] = peak_mib(fla_fb)
        except Exception as e:
            row["fla_error"] = repr(e)[:300]
    if "dense_cudnn_fb_ms" in row:
        row["ratio_vs_cudnn"] = row["nsa_fb_ms"] / row["dense_cudnn_fb_ms"]
    if "nsa_fb_graph_ms" in row and "dense_cudnn_fb_graph_ms" in row:
        row["ratio_graph_vs_cudnn"] = row["nsa_fb_graph_ms"] / row["dense_cudnn_fb_graph_ms"]
    row["target"] = TARGETS.get((family, B, T))
    return row


# Selected fwd/dQ variants timed side by side in every run (LaunchConfig fields; dK/dV is shared).
# (v4 also timed tiled with 128 rows: it lost to 64 everywhere; v6a timed by_block with fp32 dQ atomics, 128 rows
# and 1024-chooser chunks: all lost.) by_block: per key block over its choosers, partials + combine forward, one
# fused backward; its levers: partial precision, pipeline stages, choosers per program. `_inv` = the v5 dK/dV
# kernel (padded heads, inverted index) under the query-driven variants instead of the by_block one.
SELECTED_VARIANTS = {"per_query": dict(slc_kernel="per_query"),
                     "tiled64": dict(slc_kernel="tiled", slc_tile_rows=64, slc_tile_warps=4),
                     "tiled64_inv": dict(slc_kernel="tiled", slc_tile_rows=64, slc_dkdv="inverted",
                                         slc_query_dq="recompute"),
                     "by_block": dict(slc_kernel="by_block"),
                     "by_block_s2": dict(slc_kernel="by_block", slc_block_stages=2),
                     "tiled_by_block": dict(slc_kernel="tiled_by_block", slc_tile_rows=64, slc_tile_warps=4)}
# (v6b/v6c also timed by_block with fp32 partials (+1 ms at 125M, 2x the partials' memory), 4 stages (= 3) and
# 128-chooser chunks (slower): see kernels-h100-2026-11-22-v6c.md.)
# Selection (block importance + top-n): chunks of 16 * 2^splits blocks per pass over the query tiles. v6d found
# 32 and 64 blocks 2-8x slower (spills); since v34/v35 32 blocks win at head dim 128 and lose at 64, so the
# defaults differ by head dim and each variant sets both classes (kernels-notes.md v36).
SELECT_VARIANTS = {"chunk16": dict(select_d128=(64, 0, 4), select_d64=(64, 0, 4)),
                   "chunk32": dict(select_d128=(64, 1, 4), select_d64=(64, 1, 4))}
BY_BLOCK_MAX_HPG = 8  # by_block variants are timed for groups up to this size (v6a: 2x slower at 16 heads)


def range_tiles(block_m, block_n, warps, stages):
    """The same tiles for every range kernel (forward, dQ, dK/dV) and every head dim."""
    return {name: (block_m, block_n, warps, stages) for name in ti.RANGE_TILE_FIELDS}


# Compressed/window variants timed side by side in every run: v4 (every tile masked, eager delta, one compressed
# dK/dV program per key tile and head), then one lever at a time (fused delta kernel, edge-only masking, query
# chunks in the compressed dK/dV), then tile shapes (with all three levers).
RANGE_VARIANTS = {
    "v4": dict(range_kernel="masked", delta_kernel="torch", range_dkdv_programs=1, **range_tiles(64, 64, 4, 2)),
    "delta": dict(range_kernel="masked", delta_kernel="fused", range_dkdv_programs=1, **range_tiles(64, 64, 4, 2)),
    "split": dict(range_kernel="split", delta_kernel="fused", range_dkdv_programs=1, **range_tiles(64, 64, 4, 2)),
    "chunks": dict(range_kernel="split", delta_kernel="fused", range_dkdv_programs=2048,
                   **range_tiles(64, 64, 4, 2)),
    "chunks_8k": dict(range_kernel="split", delta_kernel="fused", range_dkdv_programs=8192,
                      **range_tiles(64, 64, 4, 2)),
    # v5a (paper rows) also timed 64x64 with 3 stages, 64x128 and 128x64 with 4 warps and 3 stages: all lost
    "win_per_head": dict(range_kernel="split", delta_kernel="fused", window_dkdv="head",
                         **range_tiles(64, 64, 4, 2)),
    "split_128x64_w8": dict(range_kernel="split", delta_kernel="fused", **range_tiles(128, 64, 8, 2)),
    "split_128x128_w8": dict(range_kernel="split", delta_kernel="fused", **range_tiles(128, 128, 8, 2)),
}


def kernel_breakdown(fn, top=12):
    """GPU time per kernel name (ms) of one call of fn, the largest `top` and the rest summed, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        # self time: a kernel's own; 0 for the CPU ops that launched it (their totals would count it twice)
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            times[e.key[:60]] = times.get(e.key[:60], 0.0) + us / 1000.0
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["(others)"] = sum(v for _, v in ranked[top:])
    return out


def time_range_variants(pieces, nsa_fb, leaves):
    """cmp and win fwd+bwd, and the whole NSA fwd+bwd, under each range variant (an error, e.g. out of shared
    memory, is recorded for that variant)."""
    out = {}
    for label, variant in RANGE_VARIANTS.items():
        with ti.use_launch_config(dataclasses.replace(ti.launch_config(), **variant)):
            try:
                for piece in ("cmp_fb", "win_fb"):
                    out[f"range_{label}_{piece}_ms"] = bench(pieces[piece], leaves)
                out[f"range_{label}_nsa_fb_ms"] = bench(nsa_fb, leaves)
            except Exception as e:
                traceback.print_exc()
                out[f"range_{label}_error"] = repr(e)[:200]
    return out


def structured_blocks(x, cfg, scale):
    """Blocks chosen by queries that repeat over each run of sel_block positions (and so share their choices, as
    neighbouring queries of trained models mostly do); the forced blocks still follow each query."""
    q = x["q"].detach()
    B, T, H, D = q.shape
    run = cfg.sel_block
    q_runs = q[:, ::run].repeat_interleave(run, dim=1)[:, :T].contiguous()
    _, lse = ti.compressed_attention(q_runs, x["k_cmp"], x["v_cmp"], cfg, scale)
    return ti.select_blocks(q_runs, x["k_cmp"], lse, cfg, scale)


def time_selected_variants(x, blocks, do, cfg, scale, nsa_fb, leaves):
    """slc fwd+bwd of each selected variant on the real (random-input) and on structured selections, the mean
    union length per query tile of each, and the whole NSA fwd+bwd per variant."""
    out = {}
    with torch.no_grad():
        selections = {"random": blocks, "structured": structured_blocks(x, cfg, scale)}
    hpg = x["q"].shape[2] // x["k_slc"].shape[2]
    for label, variant in SELECTED_VARIANTS.items():
        if variant["slc_kernel"] in ti.BY_BLOCK_BACKWARD and hpg > BY_BLOCK_MAX_HPG:
            continue
        launch = dataclasses.replace(ti.launch_config(), **variant)
        try:  # a variant that fails (e.g. partial buffers out of memory at the largest shapes) is recorded
            with ti.use_launch_config(launch):
                for kind, sel in selections.items():
                    def fn(sel=sel):
                        ti.selected_attention(x["q"], x["k_slc"], x["v_slc"], sel, cfg, scale).backward(do)
                    out[f"slc_{kind}_{label}_ms"] = bench(fn, leaves)
                    if variant["slc_kernel"] in ("tiled", "tiled_by_block"):
                        _, tile_q = ti._selected_tile(hpg)
                        _, count, _ = ti.tile_block_union(sel, tile_q, cfg.num_sel_blocks(sel.shape[1]))
                        out[f"union_{kind}_{label}"] = float(count.float().mean())
                out[f"slc_peak_mib_{label}"] = peak_mib(
                    lambda: ti.selected_attention(x["q"], x["k_slc"], x["v_slc"], blocks, cfg, scale).backward(do))
                out[f"nsa_fb_{label}_ms"] = bench(nsa_fb, leaves)
        except Exception as e:
            traceback.print_exc()
            out[f"slc_error_{label}"] = repr(e)[:200]
            torch.cuda.empty_cache()
    with torch.no_grad():
        _, lse = ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)
    for label, variant in SELECT_VARIANTS.items():
        try:
            with ti.use_launch_config(dataclasses.replace(ti.launch_config(), **variant)):
                same = torch.equal(ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale), blocks)
                out[f"select_{label}_ms"] = bench(lambda: ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale))
                out[f"select_{label}_same"] = same
        except Exception as e:
            traceback.print_exc()
            out[f"select_error_{label}"] = repr(e)[:200]
    # gated combination: eager PyTorch vs the fused kernels, alone and inside the whole NSA
    outs = [torch.randn(do.shape, device=do.device, dtype=do.dtype, requires_grad=True) for _ in range(3)]
    gates = x["gates"]
    for label in ti.GATE_KERNELS:
        with ti.use_launch_config(dataclasses.replace(ti.launch_config(), gate_kernel=label)):
            out[f"gates_{label}_fb_ms"] = bench(lambda: ti.gated_sum(gates, *outs).backward(do), [gates, *outs])
            out[f"nsa_fb_gates_{label}_ms"] = bench(nsa_fb, leaves)
    return out


# Sweep candidates per group: LaunchConfig changes, timed on the group's shapes (geometric mean). The range kernels
# are swept one at a time (each has its own tiles; v7 and before ran all three on 64 x 64, 4 warps, 2 stages):
# larger query tiles for the forward and dQ, larger key tiles for dK/dV (FlashAttention-2's split on Hopper).
_RANGE_CANDIDATES = {
    "fwd": [(64, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)],
    "dq": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3)],
    "dkdv": [(64, 64, 4, 2), (32, 128, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2)],
}
# Head dim 128 (the paper shape): a 128 x 128 tile of q or k is 32 KB, so wider tiles need 8 warps and fewer stages.
# v60: with a group's heads packed in the forward's and dQ's rows, 32-key forward tiles won at paper 8k
_RANGE_CANDIDATES_D128 = {
    "fwd": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 3),
            (64, 32, 4, 3), (64, 32, 4, 4)],
    "dq": [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dkdv": [(64, 64, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3)],
}
# v51: at paper 64k the selection reloads each query tile's heads once a chunk, and those reloads miss the L2
# (7.7% hits, DRAM at 85% of its peak): wider chunks reload less, smaller query tiles keep fewer rows in flight;
# every one of those was slower than (64, 1, 4) on the H100 (kernels-notes.md, v51), kept here to rerun
_SELECT_CANDIDATES = [(64, 0, 4), (64, 0, 8), (64, 1, 4), (64, 1, 8), (64, 2, 8), (128, 0, 8), (128, 1, 8),
                      (32, 0, 4), (32, 1, 4), (32, 2, 4), (64, 2, 4), (32, 2, 8), (16, 2, 4), (16, 3, 4),
                      (32, 3, 8)]
SWEEP_GROUPS = {
    **{f"range_{k}_d64": ([{f"range_{k}_d64": t} for t in c], [("125m", 16, 2048), ("125m", 1, 32768)])
       for k, c in _RANGE_CANDIDATES.items()},
    **{f"range_{k}": ([{f"range_{k}": t} for t in c], [("paper", 1, 8192), ("paper", 1, 65536)])
       for k, c in _RANGE_CANDIDATES_D128.items()},
    # the selection (query tile, chunk splits, warps), per head-dim class at its preset's shapes
    "select_d64": ([{"select_d64": c} for c in _SELECT_CANDIDATES],
                   [("125m", 16, 2048), ("125m", 4, 8192), ("125m", 1, 32768)]),
    "select_d128": ([{"select_d128": c} for c in _SELECT_CANDIDATES], [("paper", 1, 8192), ("paper", 1, 65536)]),
    "by_block": ([dict(), dict(slc_block_chunk=128), dict(slc_block_chunk=512), dict(slc_block_warps=8),
                  dict(slc_block_stages=4), dict(slc_block_rows=128, slc_block_warps=8)],
                 [("125m", 16, 2048), ("125m", 1, 32768)]),
    # the tiled forward's rows (queries x heads, unpadded), warps and stages, at the shape auto gives it
    "slc_tiled": ([dict(), dict(slc_tile_rows=128, slc_tile_warps=8), dict(slc_tile_rows=128, slc_tile_warps=4),
                   dict(slc_tile_warps=8), dict(slc_tile_stages=3), dict(slc_tile_rows=32, slc_tile_warps=2)],
                  [("125m", 16, 2048)]),
    # the selected variant at small groups: by_block (partials + combine) against tiled's forward on chip
    "slc_variant": ([dict(), dict(slc_kernel="tiled_by_block"),
                     dict(slc_kernel="tiled_by_block", slc_tile_rows=128, slc_tile_warps=8),
                     dict(slc_kernel="tiled_by_block", slc_tile_rows=32, slc_tile_warps=2)],
                    [("125m", 16, 2048), ("125m", 4, 8192)]),
    # the tiled forward's and dQ's stages where auto picks them (paper 8k; the forward at 125M 16 x 2k)
    "slc": ([dict(), dict(slc_tile_stages=3), dict(slc_tile_fwd_stages_d128=2)],
            [("paper", 1, 8192), ("125m", 16, 2048)]),
    # the per-query forward and dQ (auto's choice past 16n blocks at large groups: paper 32k-64k); v37 swept them
    # for the first time since v2 and took 3 stages
    # (v38 added one warp a program, for twice the programs a multiprocessor: it lost); v59 on an H200 took 2 stages
    "slc_per_query": ([dict(), dict(slc_stages=3), dict(slc_warps=4), dict(slc_warps=4, slc_stages=3),
                       dict(slc_stages=4), dict(slc_warps=8), dict(slc_stages=1), dict(slc_warps=1),
                       dict(slc_warps=1, slc_stages=3)],
                      [("paper", 1, 32768), ("paper", 1, 65536)]),
    "dkdv": ([dict(), dict(dkdv_rows=128, dkdv_warps=8), dict(dkdv_rows=64, dkdv_warps=8)],
             [("paper", 1, 8192), ("125m", 16, 2048)]),
}


def sweep_launch_configs(groups):
    """Time each group's candidates on its shapes, one group after another, each on top of the best of the groups
    before it; return that config and the log. A candidate scores by its GPU kernel time (torch.profiler, the
    sum over a few calls): the wall-clock median of do_bench, also logged, moves by 5% between two timings of the
    same config at 125M 16 x 2k (bubbles between the eager launches), more than some candidates differ."""
    best = ti.LaunchConfig()
    log = []
    for group in groups:
        variants, shapes = SWEEP_GROUPS[group]
        scores = []
        for v in variants:
            total = 0.0
            try:
                cfg_l = dataclasses.replace(best, **v)
            except ValueError as e:
                scores.append((float("inf"), v))
                log.append({"group": group, "variant": v, "error": str(e)[:200]})
                continue
            with ti.use_launch_config(cfg_l):
                for family, B, T in shapes:
                    try:
                        ms, gpu_ms = time_pieces(family, B, T, PAPER_NSA, group)
                    except Exception as e:  # e.g. out of shared memory: that variant is out
                        ms = gpu_ms = float("inf")
                        log.append({"group": group, "variant": v, "error": repr(e)[:200]})
                    total += math.log(gpu_ms)
                    log.append({"group": group, "variant": v, "family": family, "B": B, "T": T, "ms": ms,
                                "gpu_ms": gpu_ms})
                    print(json.dumps(log[-1]), flush=True)
                    torch.cuda.empty_cache()
            scores.append((total, v))
        best = dataclasses.replace(best, **min(scores, key=lambda x: x[0])[1])
    return best, log


def gpu_kernel_ms(fn, calls=5):
    """GPU kernel time of one call of fn (ms, mean of `calls`): the sum of every kernel's own device time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        total_us += us if us is not None else getattr(e, "self_cuda_time_total", 0)
    return total_us / 1000.0 / calls


def time_pieces(family, B, T, cfg, group):
    """(wall ms by do_bench, GPU kernel ms) of the pieces a sweep group changes: range_fwd* the compressed +
    window forward, other range_* their forward + backward, select the selection, slc/dkdv/by_block the selected
    branch's forward + backward."""
    s = SHAPES[family]
    H, G, Dk, Dv = s["H"], s["G"], s["Dk"], s["Dv"]
    scale = Dk ** -0.5
    x = {n: t.requires_grad_() for n, t in make_inputs(B, T, H, G, Dk, Dv, cfg, torch.bfloat16, seed=2).items()}
    do = torch.randn(B, T, H, Dv, device="cuda", dtype=torch.bfloat16)
    if group.startswith("range_fwd"):
        def fn():
            with torch.no_grad():
                ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)
                ti.window_attention(x["q"], x["k_win"], x["v_win"], cfg.window, scale)
        return bench(fn), gpu_kernel_ms(fn)
    if group.startswith("range"):
        def fn():
            ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)[0].backward(do)
            ti.window_attention(x["q"], x["k_win"], x["v_win"], cfg.window, scale).backward(do)
    else:
        with torch.no_grad():
            _, lse = ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)
            blocks = ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale)
        if group.startswith("select"):
            def select():
                ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale)
            return bench(select), gpu_kernel_ms(select)

        def fn():
            ti.selected_attention(x["q"], x["k_slc"], x["v_slc"], blocks, cfg, scale).backward(do)
    leaves = list(x.values())

    return bench(fn, leaves), gpu_kernel_ms(fresh_grads(fn, leaves))


TIMINGS = [("paper", 1, 8192), ("paper", 1, 16384), ("paper", 1, 32768), ("paper", 1, 65536),
           ("125m", 16, 2048), ("125m", 4, 8192), ("125m", 1, 32768), ("125m", 1, 65536)]
# timed only when --timings names them: dense attention alone takes seconds a call there
LONG_TIMINGS = [("paper", 1, 131072)]


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def markdown(meta, checks, rows):
    lines = [f"# Triton NSA kernels: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']} (nsa_model {meta.get('nsa_model', '?').split()[0]}), torch {meta['torch']}, "
             f"triton {meta['triton']}, bf16, "
             f"median of triton.testing.do_bench, fwd+bwd unless marked.", "",
             f"launch config: {meta['launch_config']}", "",
             "## Correctness (bf16 vs float64 reference on the GPU)", "",
             "| case | B | T | H/G | Dk/Dv | rel err o | worst rel err grad | selection rows differing (near-ties) | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        if "error" in c:
            lines.append(f"| {c['case']} | error: {c['error'][:120]} |||||||| no |")
            continue
        g = [v for k, v in c.items() if k.startswith("d") and k[1:] in NAMES]
        lines.append(f"| {c['case']} | {c['B']} | {c['T']} | {c['H']}/{c['G']} | {c['Dk']}/{c['Dv']} | "
                     f"{c['o']:.2e} | {fmt(max(g) if g else None, '.2e')} | {c['selection_rows_differing']} "
                     f"({c['selection_near_ties']}) | {'yes' if c['ok'] else 'NO'} |")
    lines += ["", "## Time (ms) and ratio to dense cuDNN", "",
              "| config | B x T | NSA fwd+bwd | NSA fwd | cmp | select (fwd) | slc | win | rest (gates, glue) | "
              "dense cuDNN | dense FA2 | fla parallel_nsa | NSA / cuDNN | target | peak MiB NSA / cuDNN |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | error: {r['error'][:120]} |")
            continue
        rest = r["nsa_fb_ms"] - sum(r[k + "_ms"] for k in ("cmp_fb", "select_f", "slc_fb", "win_fb"))
        lines.append(
            f"| {r['family']} | {r['B']} x {r['T']} | {r['nsa_fb_ms']:.2f} | {r['nsa_f_ms']:.2f} | "
            f"{r['cmp_fb_ms']:.2f} | {r['select_f_ms']:.2f} | {r['slc_fb_ms']:.2f} | {r['win_fb_ms']:.2f} | "
            f"{rest:.2f} | {fmt(r.get('dense_cudnn_fb_ms'))} | {fmt(r.get('dense_flash_fb_ms'))} | "
            f"{fmt(r.get('fla_fb_ms'))} | {fmt(r.get('ratio_vs_cudnn'), '.3f')} | {fmt(r.get('target'))} | "
            f"{r['nsa_fb_peak_mib']:.0f} / {fmt(r.get('dense_cudnn_fb_peak_mib'), '.0f')} |")
    graphed = [r for r in rows if "ratio_graph_vs_cudnn" in r]
    if graphed:
        lines += ["", "## The same fwd+bwd replayed as one CUDA graph (GPU time, no host launch cost)", "",
                  "How training runs the core under compile_mode reduce-overhead. cuDNN is one launch each way, so the "
                  "eager ratio above also charges NSA the host's time to launch its ~25 kernels per call.", "",
                  "| config | B x T | NSA graph ms | cuDNN graph ms | NSA / cuDNN (graph) | eager ratio | target |",
                  "|---|---|---|---|---|---|---|"]
        for r in graphed:
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | {r['nsa_fb_graph_ms']:.2f} | "
                         f"{r['dense_cudnn_fb_graph_ms']:.2f} | {r['ratio_graph_vs_cudnn']:.3f} | "
                         f"{fmt(r.get('ratio_vs_cudnn'), '.3f')} | {fmt(r.get('target'))} |")
    pieces = [r for r in rows if "cmp_fb_gpu_ms" in r]
    if pieces:
        lines += ["", "## GPU kernel time of each piece alone (torch.profiler, ms; the eager times above are "
                  "launch-bound at small shapes)", "",
                  "| config | B x T | cmp fwd+bwd | select (fwd) | slc fwd+bwd | win fwd+bwd |",
                  "|---|---|---|---|---|---|"]
        for r in pieces:
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | {r['cmp_fb_gpu_ms']:.3f} | "
                         f"{r['select_f_gpu_ms']:.3f} | {r['slc_fb_gpu_ms']:.3f} | {r['win_fb_gpu_ms']:.3f} |")
    if any("slc_random_per_query_ms" in r for r in rows):  # a section this run did not time is left out
        lines += ["", "## Selected-branch variants (fwd+bwd ms; union = mean distinct blocks per query tile)", "",
                  "| config | B x T | selection | " + " | ".join(SELECTED_VARIANTS) + " | union tiled64 |",
                  "|---|---|---|" + "---|" * (len(SELECTED_VARIANTS) + 1)]
        for r in rows:
            if "error" in r:
                continue
            for kind in ("random", "structured"):
                times = " | ".join(fmt(r.get(f"slc_{kind}_{v}_ms")) for v in SELECTED_VARIANTS)
                unions = fmt(r.get(f"union_{kind}_tiled64"), ".1f")
                lines.append(f"| {r['family']} | {r['B']} x {r['T']} | {kind} | {times} | {unions} |")
            times = " | ".join(fmt(r.get(f"nsa_fb_{v}_ms")) for v in SELECTED_VARIANTS)
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | whole NSA | {times} | |")
            peaks = " | ".join(fmt(r.get(f"slc_peak_mib_{v}"), ".0f") for v in SELECTED_VARIANTS)
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | slc peak MiB | {peaks} | |")
    if any("select_chunk16_ms" in r for r in rows):
        lines += ["", "## Selection variants (fwd ms; same = identical blocks to the default's)", "",
                  "| config | B x T | " + " | ".join(SELECT_VARIANTS) + " |", "|---|---|" + "---|" * len(SELECT_VARIANTS)]
        for r in rows:
            if "error" not in r:
                cells = [f"{fmt(r.get(f'select_{v}_ms'))} ({'same' if r.get(f'select_{v}_same') else 'DIFFERENT'})"
                         for v in SELECT_VARIANTS]
                lines.append(f"| {r['family']} | {r['B']} x {r['T']} | " + " | ".join(cells) + " |")
    if any(k.startswith("range_") for r in rows for k in r):  # a section this run did not time is left out
        lines += ["", "## Range-branch variants (fwd+bwd ms: compressed / window / whole NSA)", "",
                  "| config | B x T | " + " | ".join(RANGE_VARIANTS) + " |", "|---|---|" + "---|" * len(RANGE_VARIANTS)]
        for r in rows:
            if "error" in r:
                continue
            cells = []
            for v in RANGE_VARIANTS:
                if f"range_{v}_error" in r:
                    cells.append("error")
                else:
                    pieces = ("cmp_fb", "win_fb", "nsa_fb")
                    cells.append(" / ".join(fmt(r.get(f"range_{v}_{p}_ms")) for p in pieces))
            lines.append(f"| {r['family']} | {r['B']} x {r['T']} | " + " | ".join(cells) + " |")
    if any("kernel_ms" in r for r in rows):
        lines += ["", "## Kernels of one NSA fwd+bwd (torch.profiler, GPU ms per kernel name, largest first)", ""]
        for r in rows:
            if "kernel_ms" in r:
                lines.append(f"- {r['family']} {r['B']} x {r['T']}: " + ", ".join(
                    f"{name} {ms:.3f}" for name, ms in r["kernel_ms"].items()))
    if any("gates_fused_fb_ms" in r for r in rows):  # a section this run did not time is left out
        lines += ["", "## Gated combination (fwd+bwd ms): eager PyTorch vs fused kernels, alone and in the whole NSA",
                  "",
                  "| config | B x T | gates torch | gates fused | NSA with torch gates | NSA with fused gates |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            if "error" not in r:
                lines.append(f"| {r['family']} | {r['B']} x {r['T']} | {fmt(r.get('gates_torch_fb_ms'))} | "
                             f"{fmt(r.get('gates_fused_fb_ms'))} | {fmt(r.get('nsa_fb_gates_torch_ms'))} | "
                             f"{fmt(r.get('nsa_fb_gates_fused_ms'))} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="only the first two checks and timings")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", default="", help="comma-separated sweep groups (SWEEP_GROUPS) to run first: pick "
                    "launch parameters by timing candidates, then check and time with them")
    ap.add_argument("--checks", default="", help="comma-separated check names to run (default: all)")
    ap.add_argument("--timings", type=lambda text: family_shapes(text, SHAPES), default=[],
                    help="comma-separated family:B:T to time, e.g. 125m:16:2048 (default: all of TIMINGS, in that "
                    "order)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated optional parts of each timing row, of {SECTIONS}")
    ap.add_argument("--suffix", type=file_suffix, default="", help="appended to the result files' names, e.g. -v4")
    ap.add_argument("--commit", default="", help="commit id to record, for a copy of the tree without its git")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                    help="a LaunchConfig field to change for this run (repeatable), e.g. side_stream=False")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU")
    overrides = launch_overrides(args.launch)
    if overrides:
        ti.set_launch_config(dataclasses.replace(ti.launch_config(), **overrides))
    os.makedirs(args.out, exist_ok=True)
    try:
        import fla.ops.nsa  # noqa: F401
        have_fla = True
    except Exception as e:
        print("fla-core not importable:", repr(e)[:200])
        have_fla = False
    stem, meta = result_stem(args.out, "kernels", args.suffix, args.commit or git_commit())
    meta.update(python=platform.python_version(), launch_config=ti.launch_config().__dict__)
    checks, rows = [], []

    def save():
        result_file(stem, ".json").write_text(json.dumps({"meta": meta, "checks": checks, "timings": rows,
                                                          "sweep": sweep_log}, indent=1))
        result_file(stem, ".md").write_text(markdown(meta, checks, rows))

    sweep_log = []
    if args.sweep:
        groups = args.sweep.split(",")
        if any(g not in SWEEP_GROUPS for g in groups):
            raise SystemExit(f"--sweep: not all of {groups} are in {list(SWEEP_GROUPS)}")
        chosen, sweep_log = sweep_launch_configs(groups)
        ti.set_launch_config(chosen)  # for the rest of this run
        meta["launch_config"] = ti.launch_config().__dict__
        print("launch config:", meta["launch_config"], flush=True)
    wanted = [c for c in CHECKS if not args.checks or c["name"] in args.checks.split(",")]
    for c in ([] if args.skip_checks else wanted[:2] if args.quick else wanted):
        name, cfg, c = check_case(c)
        start = time.time()
        try:
            r = check_bf16(name, cfg=cfg, **c)
        except Exception as e:
            traceback.print_exc()
            r = {"case": name, "error": repr(e)[:500], "ok": False}
        r["seconds"] = round(time.time() - start, 1)
        print(json.dumps(r), flush=True)
        checks.append(r)
        torch.cuda.empty_cache()
        save()
    timings = TIMINGS[:1] + TIMINGS[4:5] if args.quick else TIMINGS
    if args.timings:
        unknown = [w for w in args.timings if w not in TIMINGS + LONG_TIMINGS]
        if unknown:
            raise SystemExit(f"--timings: {unknown} not in TIMINGS {TIMINGS} or LONG_TIMINGS {LONG_TIMINGS}")
        timings = args.timings  # in the order given
    for family, B, T in timings:
        start = time.time()
        try:
            r = time_config(family, B, T, PAPER_NSA, have_fla, sections=args.sections.split(","))
        except Exception as e:
            traceback.print_exc()
            r = {"family": family, "B": B, "T": T, "error": repr(e)[:500]}
        r["seconds"] = round(time.time() - start, 1)
        print(json.dumps(r), flush=True)
        rows.append(r)
        torch.cuda.empty_cache()
        save()
    print(markdown(meta, checks, rows))


if __name__ == "__main__":
    main()
