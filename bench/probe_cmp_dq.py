"""Probe (agreement and timing): the compressed branch's dQ added from its dK/dV kernel (FlashAttention's five
products a tile) against the dQ kernel of its own (seven products: the dQ kernel computes S and dP again).

    python bench/probe_cmp_dq.py [--shapes paper:1:65536,...] [--variants 0:4:2 1:8:2 ...] --out DIR --commit SHA

The variants are kernels/range_attention.py with FUSED_DQ built into range_attn_bwd_dkdv_kernel by editing its
source (bench/kernel_variants.py; the switch was in the kernel at 7402904 and 8c8dcd1, and left it when it lost,
kernels-notes.md v82). FUSED_DQ adds each (query tile, key tile)'s dS K into a float32 dQ: 1 by element atomic
adds, 2 by the tensor memory accelerator's bulk reduce-add (one instruction a tile); 3 computes dS K but adds
nothing (the fifth product's own cost). A variant is FUSED_DQ:warps:stages[:query tile:key tile] (default tiles
64 x 64); 0:4:2 is the kernel as the core runs it.
Per shape, ms of the GPU (median of CUDA-event timings, each kernel alone):
- cmp dK/dV: the compressed branch's dK/dV kernel, each variant (a fused one with its float32 dQ's zero fill);
- dQ pair: the range dQ kernel over both ranges, as nsa::core's backward runs it, and window dQ: over the window
  range alone, which is what is left of it once the compressed dQ comes from the dK/dV kernel.
A fused variant wins if its cmp dK/dV + window dQ is less than 0:4:2's cmp dK/dV + dQ pair. Before timing, each
variant's dQ, dK and dV are compared with the separate kernels' (bf16 inputs, float32 sums).
Writes DIR/probe-<device>-<date><suffix>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_variants import edited_module  # noqa: E402
from bench.provenance import file_suffix, git_commit  # noqa: E402
from bench.shapes import FAMILIES, family_shapes  # noqa: E402

# FUSED_DQ, as edits of kernels/range_attention.py: the switch and its pointers through the kernel and its tile loop
FUSED_DQ_EDITS = [
    ("               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):\n"
     "    \"\"\"dk, dv plus the key tile's share from the query tile start_m.. of head h.\"\"\"",
     "               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DQ_ACC=None, DQD=None, scale=1.0,\n"
     "               FUSED_DQ: tl.constexpr = 0):\n"
     "    \"\"\"dk, dv plus the key tile's share from the query tile start_m.. of head h.\"\"\""),
    ("    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)\n    return dk, dv\n",
     "    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)\n"
     "    if FUSED_DQ > 0:\n"
     "        dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * scale\n"
     "        if FUSED_DQ == 3:  # the product alone: a store that never runs keeps it in the code\n"
     "            if start_m < 0:\n"
     "                tl.store(DQ_ACC + row_q[:, None] * DK + tl.arange(0, BLOCK_DK)[None, :], dq)\n"
     "        elif FUSED_DQ == 2:\n"
     "            DQD.atomic_add([b * T + start_m, h * DK], dq)\n"
     "        else:\n"
     "            offs_dk = tl.arange(0, BLOCK_DK)\n"
     "            tl.atomic_add(DQ_ACC + row_q[:, None] * DK + offs_dk[None, :], dq,\n"
     "                          mask=m_ok[:, None] & (offs_dk < DK)[None, :], sem=\"relaxed\")\n"
     "    return dk, dv\n"),
    ("TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1):",
     "TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1, DQ_ACC=None, DQD=None,\n"
     "                scale=1.0, FUSED_DQ: tl.constexpr = 0):"),
    ("BLOCK_M, MASKED, TMA, DOT_PRECISION)", "BLOCK_M, MASKED, TMA, DOT_PRECISION, DQ_ACC, DQD, scale, FUSED_DQ)"),
    ("LOOP_HEADS: tl.constexpr = 1):",
     "LOOP_HEADS: tl.constexpr = 1, DQ_ACC=None, DQD=None,\n"
     "                               FUSED_DQ: tl.constexpr = 0):"),
    ("TMA, DOT_PRECISION, LOOP_HEADS)\n", "TMA, DOT_PRECISION, LOOP_HEADS, DQ_ACC, DQD, scale, FUSED_DQ)\n"),
]


def variant(name: str, edits):
    """The range-attention module with `edits` applied (None where an edit's text is not in the source)."""
    return edited_module("range_attention.py", name, edits)


def parse_variant(text: str) -> tuple[int, ...]:
    """FUSED_DQ:warps:stages, optionally :query tile:key tile (else the dK/dV's defaults)."""
    parts = tuple(int(x) for x in text.split(":"))
    if len(parts) not in (3, 5) or parts[0] not in (0, 1, 2, 3) or parts[1] not in (4, 8) or parts[2] < 1:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected FUSED_DQ (0-3):warps (4, 8):stages"
                                         "[:query tile:key tile]")
    return parts


_FUSED = []


def _fused_module():
    """The edited module, built once (each build is a module of its own, whose kernels compile again)."""
    if not _FUSED:
        module = variant("fused dQ", FUSED_DQ_EDITS)
        if module is None:
            raise SystemExit("FUSED_DQ_EDITS no longer apply to kernels/range_attention.py")
        _FUSED.append(module)
    return _FUSED[0]


def cmp_dkdv(inputs: dict, case: tuple[int, ...]):
    """(dk, dv, dq or None) of the compressed branch by range_attn_bwd_dkdv_kernel in this case (FUSED_DQ 0:
    the kernel as it is), launched as ops/triton_impl.py's _range_dkdv_into launches it."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from nsa_model.kernels import range_attention
    from nsa_model.ops import triton_impl as ti

    fused, warps, stages, *tiles = case
    module = range_attention if fused == 0 else _fused_module()
    q = inputs["q"]
    extra, dq = {}, None  # the kernel as it is has no FUSED_DQ argument
    if fused:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        extra["FUSED_DQ"] = fused
        if fused == 2:
            B, T, H, D = q.shape
            block_m = tiles[0] if tiles else ti._range_launch(q, inputs["vc"], "dkdv")["BLOCK_M"]
            extra["DQD"] = TensorDescriptor(dq, [B * T, H * D], [H * D, 1], [block_m, D])
        else:
            extra["DQ_ACC"] = dq
    dk, dv = launch_cmp_dkdv(module, inputs, warps, stages, tiles, extra)
    return dk, dv, dq


def launch_cmp_dkdv(module, inputs: dict, warps: int, stages: int, tiles=(), extra=None):
    """(dk, dv): `module`'s range_attn_bwd_dkdv_kernel on the compressed branch of `inputs` at these warps, stages
    and (query tile, key tile) (empty: the launch config's), launched as ops/triton_impl.py's _range_dkdv_into
    launches it, with `extra` keyword arguments of a variant's own."""
    import triton

    from nsa_model.ops import triton_impl as ti

    q, kc, vc, do, lse, delta, scale = (inputs[n] for n in ("q", "kc", "vc", "do", "lse_cmp", "delta_cmp", "scale"))
    B, T, H, D = q.shape
    G = kc.shape[2]
    key_stride, key_offset, window = inputs["cmp_range"]
    launch = dict(ti._range_launch(q, vc, "dkdv"), num_warps=warps, num_stages=stages)
    if tiles:
        launch.update(BLOCK_M=tiles[0], BLOCK_N=tiles[1])
    atomic, head_split, q_chunk, aligned = ti._range_dkdv_split(q, kc, vc, T, window)
    q_chunk = triton.cdiv(q_chunk, launch["BLOCK_M"]) * launch["BLOCK_M"]
    dk, dv = ti._fp32_accumulators(kc, vc)
    grid = (B * G * head_split, triton.cdiv(kc.shape[1], launch["BLOCK_N"]), triton.cdiv(T, q_chunk))
    module.range_attn_bwd_dkdv_kernel[(grid[1], grid[0], grid[2]) if aligned else grid](
        q, kc, vc, do, LSE=lse, DELTA=delta, DK_ACC=dk, DV_ACC=dv, T=T, num_queries=T, num_keys=kc.shape[1],
        scale=scale, key_stride=key_stride, key_offset=key_offset, window=window, q_chunk=q_chunk,
        **ti._kv_strides(kc, vc), HEAD_SPLIT=head_split, ATOMIC=atomic, H=H, G=G, **ti._head_dims(q, vc), **launch,
        **ti._tile_args(launch, dict(QD=q, DOD=do), dict(KD=kc, VD=vc)), ALIGNED_CHUNKS=aligned, **(extra or {}))
    return dk, dv


def make_inputs(B: int, T: int, H: int, G: int, D: int, device: str = "cuda", dtype=None) -> dict:
    """Random inputs (bf16 on the GPU, seed 0), NSAConfig's defaults, the row terms of the real forwards."""
    import torch

    from nsa_model.config import NSAConfig
    from nsa_model.ops import triton_impl as ti

    cfg = NSAConfig()
    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(B, T, H, D, device=device, generator=gen).to(dtype)
    do = torch.randn(B, T, H, D, device=device, generator=gen).to(dtype)
    kw, vw = (torch.randn(B, T, G, D, device=device, generator=gen).to(dtype) for _ in range(2))
    tc = cfg.num_cmp_tokens(T)
    kc, vc = (torch.randn(B, tc, G, D, device=device, generator=gen).to(dtype) for _ in range(2))
    scale = D ** -0.5
    cmp_range, win_range = ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), ti._win_range(cfg.window, T)
    o_cmp, lse_cmp = ti._range_fwd(q, kc, vc, *cmp_range, scale)
    o_win, lse_win = ti._range_fwd(q, kw, vw, *win_range, scale)
    return dict(q=q, do=do, kw=kw, vw=vw, kc=kc, vc=vc, scale=scale, cmp_range=cmp_range, win_range=win_range,
                lse_cmp=lse_cmp, delta_cmp=ti._delta(do, o_cmp), lse_win=lse_win, delta_win=ti._delta(do, o_win))


def range_dq(inputs: dict, pair: bool, branch: str = "win"):
    """dQ of the window range (pair: plus the compressed one, one launch, as nsa::core runs them), or of the
    compressed range alone (branch "cmp", pair False)."""
    import torch

    from nsa_model.ops import triton_impl as ti

    x = inputs
    dq = torch.empty_like(x["q"])
    k, v, lse, delta, rng = ((x["kc"], x["vc"], x["lse_cmp"], x["delta_cmp"], x["cmp_range"]) if branch == "cmp"
                             else (x["kw"], x["vw"], x["lse_win"], x["delta_win"], x["win_range"]))
    second = (x["kc"], x["vc"], x["lse_cmp"], x["delta_cmp"], *x["cmp_range"]) if pair else None
    ti._range_dq_into(x["q"], k, v, x["do"], lse, delta, dq, x["q"].shape[1], *rng, x["scale"], second=second)
    return dq


def gpu_ms(fn, reps: int) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="paper:1:65536,paper:1:32768,paper:1:8192")
    ap.add_argument("--variants", type=parse_variant, nargs="+",
                    default=[parse_variant(v) for v in ("0:4:2", "1:4:2", "2:4:2", "1:8:2", "2:8:2")])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--suffix", type=file_suffix, default="")
    args = ap.parse_args()
    import torch

    from bench.kernel_variants import write_times

    commit = args.commit or git_commit()
    results, errors = {}, []
    for family, b, t in family_shapes(args.shapes):
        spec = f"{family}:{b}:{t}"
        x = make_inputs(b, t, **FAMILIES[family])
        dk_ref, dv_ref, _ = cmp_dkdv(x, (0, 4, 2))
        dq_ref = range_dq(x, pair=False, branch="cmp").float()
        row = {}
        for case in args.variants:
            name = "cmp dK/dV " + ":".join(map(str, case))
            try:
                dk, dv, dq = cmp_dkdv(x, case)
            except Exception as e:  # e.g. out of shared memory at these tiles: that variant is out
                print(f"{spec} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                row[name] = float("nan")
                continue
            adds = case[0] in (1, 2)
            errs = [rel_err(dk, dk_ref), rel_err(dv, dv_ref)] + ([rel_err(dq, dq_ref)] if adds else [])
            errors.append(f"{spec} {name}: rel err dK {errs[0]:.1e}, dV {errs[1]:.1e}"
                          + (f", dQ {errs[2]:.1e}" if adds else ""))
            print(errors[-1], flush=True)
            if max(errs) > 2e-2:
                raise SystemExit(f"{spec} {name}: disagrees with the separate kernels ({errs})")
            row[name] = gpu_ms(lambda: cmp_dkdv(x, case), args.reps)
            print(f"{spec} {name}: {row[name]:.3f} ms", flush=True)
        row["dQ pair"] = gpu_ms(lambda: range_dq(x, pair=True), args.reps)
        row["window dQ"] = gpu_ms(lambda: range_dq(x, pair=False), args.reps)
        print(spec, row, flush=True)
        results[spec] = row
        x = None  # free the inputs before the next shape
        torch.cuda.empty_cache()
    note = ("GPU ms, median of CUDA-event timings, each kernel alone; a variant is FUSED_DQ:warps:stages of the "
            "compressed dK/dV (64 x 64 tiles; 0 = the kernel as nsa::core runs it). A fused variant replaces "
            "0:4:2 + dQ pair by itself + window dQ.\n\nAgreement with the separate kernels: " + "; ".join(errors))
    stem = write_times(args.out, args.suffix, commit, results, title="the compressed dQ from its dK/dV kernel",
                       note=note, unit="ms", fmt=".3f")
    print("wrote", stem)


if __name__ == "__main__":
    main()
