"""A spike: the selected forward with one warp per query over block loads shared by a tile, in Gluon.

Why (kernels-notes.md v38, v51). At the paper shapes (16 heads a group) the selected branch is the largest piece
of the core, and neither tl kernel does only the work it needs:
- `selected_attn_fwd_kernel` (per query) runs one query's 16 heads against each of its blocks: 16-row products,
  no wasted work, but every block is loaded for every query, and it sits on the L2's bandwidth roof (v51: 88.6%
  of its peak at paper 64k);
- `selected_tiled_fwd_kernel` loads the union of a 4-query tile's blocks once, but runs all 64 rows against
  every block of the union: 2.2x the products its queries need at paper 8k.
v38's try at both (each query's 16-row state in one program, a branch on whether the query chose the block) lost:
a branch around a tl dot keeps Triton from pipelining the loop. Here the branch is per warp, the one place a
GPU takes it for free: a loader warp copies each block of the tile's union into a ring of shared-memory slots
(TMA), and QUERIES worker warps, one per query, each wait for a slot, run their 16 rows against it with
Ampere-style warp MMAs (mma.sync, 16 rows a warp) only if their query chose the block, and free it.

Same function as the tl kernels (NSA_SPEC.md section 5): per (query, head) the softmax over the keys of the
query's chosen blocks at or before it; o in the input dtype, lse in natural-log units, -inf and 0 where a query
chose nothing. Head dim 128, 16 heads a group, l' = 64, as the paper shapes.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_selected_fwd.py --out DIR (checks each variant's o and lse
against the tl tiled kernel's, then times the tl tiled and per-query forwards and each variant, same inputs).
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.provenance import file_suffix, git_commit, result_file, result_stem

LOG2E = 1.4426950408889634


@gluon.jit
def _loader(k_desc, v_desc, UNION, k_ring, v_ring, ready, empty, union_row, count, b, g, T, D: gl.constexpr,
            SEL_BLOCK: gl.constexpr, WIDTH: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: block i of the tile's union into slot i % STAGES once every query warp freed it."""
    for i in range(count):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh slot passes: phase 1 counts as done
        blk = gl.load(UNION + union_row * WIDTH + i)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b * T + blk * SEL_BLOCK, g * D], ready.index(s), k_ring.index(s))
        tma.async_copy_global_to_shared(v_desc, [b * T + blk * SEL_BLOCK, g * D], ready.index(s), v_ring.index(s))


@gluon.jit
def _query_rows(Q, b, g, t, T, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, a_layout: gl.constexpr):
    """q of query t's HPG heads of group g, [HPG, D], in the warp MMA's A-operand layout (zeros past T)."""
    HPG: gl.constexpr = H // G
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                        order=[1, 0])
    r = gl.arange(0, HPG, layout=gl.SliceLayout(1, ld))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    row = (b * T + t).to(gl.int64) * H + g * HPG + r
    ok = gl.expand_dims((r < HPG) & (t < T), 1) & gl.expand_dims(d < D, 0)
    q = gl.load(Q + gl.expand_dims(row, 1) * D + gl.expand_dims(d, 0), mask=ok, other=0.0)
    return gl.convert_layout(q, a_layout)


@gluon.jit
def _store_rows(O, LSE, acc, m_i, l_i, b, g, t, T, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                rows_layout: gl.constexpr):
    """o = acc / l (16-byte stores) and lse = (m + log2 l) / log2(e) of query t's heads; 0 and -inf where the
    query saw no key."""
    HPG: gl.constexpr = H // G
    st: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                        order=[1, 0])
    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    o = gl.convert_layout((acc / gl.expand_dims(l_safe, 1)).to(O.dtype.element_ty), st)
    r = gl.arange(0, HPG, layout=gl.SliceLayout(1, st))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, st))
    row = (b * T + t).to(gl.int64) * H + g * HPG + r
    gl.store(O + gl.expand_dims(row, 1) * D + gl.expand_dims(d, 0), o,
             mask=gl.expand_dims((r < HPG) & (t < T), 1) & gl.expand_dims(d < D, 0))
    r_l = gl.arange(0, HPG, layout=rows_layout)
    row_l = (b * T + t).to(gl.int64) * H + g * HPG + r_l
    lse = gl.where(has_key, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    gl.store(LSE + row_l, lse, mask=(r_l < HPG) & (t < T))


@gluon.jit
def _query_warp(Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t, T, qk_scale,
                H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr, N_SELECT: gl.constexpr,
                N_PAD: gl.constexpr, WIDTH: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr):
    """One query's warp: its HPG heads against every block of the union it chose, online softmax in registers.
    The products run on two halves of the block's keys, so a B operand is [D, 32] (K^T) or [32, D] (V): 32
    registers a thread instead of 128 for the whole block."""
    HPG: gl.constexpr = H // G
    HALF: gl.constexpr = SEL_BLOCK // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    choice_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1],
                                                   order=[0])

    q = _query_rows(Q, b, g, t, T, H, G, D, a_layout)
    offs_n = gl.arange(0, N_PAD, layout=choice_layout)
    chosen = gl.load(BLOCKS + ((b * T + t).to(gl.int64) * G + g) * N_SELECT + offs_n,
                     mask=(offs_n < N_SELECT) & (t < T), other=-1)
    key = gl.arange(0, HALF, layout=cols_layout)
    s_zero = gl.zeros([HPG, HALF], gl.float32, layout=mma)
    m_i = gl.full([HPG], float("-inf"), gl.float32, layout=rows_layout)
    l_i = gl.zeros([HPG], gl.float32, layout=rows_layout)
    acc = gl.zeros([HPG, D], gl.float32, layout=mma)
    for i in range(count):
        s = i % STAGES
        blk = gl.load(UNION + union_row * WIDTH + i)
        member = gl.max((chosen == blk).to(gl.int32), axis=0) > 0
        if PROBE == 1:  # timing probe, wrong values: every warp computes on every block (no skipping)
            member = t >= 0
        elif PROBE == 2:  # timing probe, wrong values: no warp computes (the loads and barriers alone)
            member = t < 0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if member:  # a warp-uniform branch: the other query warps go on to the next block
            kt = k_ring.index(s).permute((1, 0))
            s0 = mma_v2(q, kt.slice(0, HALF, dim=1).load(b_layout), s_zero)
            s1 = mma_v2(q, kt.slice(HALF, HALF, dim=1).load(b_layout), s_zero)
            pos0 = blk * SEL_BLOCK + key
            s0 = gl.where(gl.expand_dims(pos0 <= t, 0), s0, float("-inf"))
            s1 = gl.where(gl.expand_dims(pos0 + HALF <= t, 0), s1, float("-inf"))
            m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, axis=1), gl.max(s1, axis=1)) * qk_scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p0 = gl.exp2(s0 * qk_scale - gl.expand_dims(m_safe, 1))
            p1 = gl.exp2(s1 * qk_scale - gl.expand_dims(m_safe, 1))
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p0, axis=1) + gl.sum(p1, axis=1)
            acc = acc * gl.expand_dims(alpha, 1)
            vs = v_ring.index(s)
            acc = mma_v2(gl.convert_layout(p0.to(vs.dtype), a_layout), vs.slice(0, HALF, dim=0).load(b_layout), acc)
            acc = mma_v2(gl.convert_layout(p1.to(vs.dtype), a_layout), vs.slice(HALF, HALF, dim=0).load(b_layout),
                         acc)
            m_i = m_new
        mbarrier.arrive(empty.index(s), count=1)
    _store_rows(O, LSE, acc, m_i, l_i, b, g, t, T, H, G, D, rows_layout)


@gluon.jit
def _query_warp_0(Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T, qk_scale,
                  H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr, N_SELECT: gl.constexpr,
                  N_PAD: gl.constexpr, WIDTH: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr,
                  W: gl.constexpr):
    """The query warp of the tile's query W (a partition's arguments are the same values for every worker, so the
    query's offset comes in as a constexpr)."""
    _query_warp(Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0 + W, T, qk_scale,
                H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE)


@gluon.jit
def selected_shared_fwd_kernel(Q, k_desc, v_desc, BLOCKS, UNION, COUNT, O, LSE, T, num_tiles, qk_scale,
                               H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr,
                               N_SELECT: gl.constexpr, N_PAD: gl.constexpr, QUERIES: gl.constexpr,
                               STAGES: gl.constexpr, WORKER_REGS: gl.constexpr,
                               PROBE: gl.constexpr = 0):
    """One program per (tile of QUERIES consecutive queries, batch x group): the default partition (this launch's
    num_warps = 4; the TMA copies need one thread) loads the union's blocks, QUERIES one-warp partitions compute."""
    gl.static_assert(QUERIES == 4 or QUERIES == 8, "the spike writes out 4 or 8 query warps")
    WIDTH: gl.constexpr = QUERIES * N_SELECT
    pid_tile = gl.program_id(0)
    pid_bg = gl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    union_row = (b * num_tiles + pid_tile).to(gl.int64) * G + g
    count = gl.load(COUNT + union_row)
    t0 = pid_tile * QUERIES
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, SEL_BLOCK, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, SEL_BLOCK, D], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=QUERIES)  # every query warp frees the slot, member or not
    fence_async_shared()
    # A partition's arguments are spelled out in the call (Gluon takes no tuple arithmetic or function values
    # here); each query warp gets its query's offset W in the tile as a constexpr.
    if QUERIES == 4:
        gl.warp_specialize([
            (_loader, (k_desc, v_desc, UNION, k_ring, v_ring, ready, empty, union_row, count, b, g, T, D, SEL_BLOCK,
                       WIDTH, STAGES)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 0)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 1)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 2)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 3)),
        ], [1, 1, 1, 1], [WORKER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS])
    else:
        gl.warp_specialize([
            (_loader, (k_desc, v_desc, UNION, k_ring, v_ring, ready, empty, union_row, count, b, g, T, D, SEL_BLOCK,
                       WIDTH, STAGES)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 0)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 1)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 2)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 3)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 4)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 5)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 6)),
            (_query_warp_0, (Q, BLOCKS, UNION, O, LSE, k_ring, v_ring, ready, empty, union_row, count, b, g, t0, T,
                             qk_scale, H, G, D, SEL_BLOCK, N_SELECT, N_PAD, WIDTH, STAGES, PROBE, 7)),
        ], [1, 1, 1, 1, 1, 1, 1, 1], [WORKER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS, WORKER_REGS,
                                       WORKER_REGS, WORKER_REGS])


def _desc(x2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), block, layout)


def selected_shared_fwd(q, k, v, blocks, scale: float, sel_block: int = 64, queries: int = 4, stages: int = 3,
                        worker_regs: int = 216, maxnreg: int | None = 128, fill: float | None = None,
                        probe: int = 0):
    """(o, lse) of the selected branch: q [B, T, H, D], k and v [B, T, G, D] contiguous bf16, blocks [B, T, G, n]
    int32 (-1 = none). fill: the outputs start as this value (NaN for a check). probe: 0, or a timing probe with
    wrong values: 1 every query warp computes on every block of the union, 2 none does (loads and barriers only)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    if H // G != 16 or D != 128 or q.dtype != torch.bfloat16:
        raise ValueError(f"the spike takes 16 heads a group, head dim 128 and bf16; got H/G={H // G}, D={D}, "
                         f"{q.dtype}")
    if queries not in (4, 8):
        raise ValueError(f"the spike takes 4 or 8 queries a tile; got {queries}")
    from nsa_model.ops import triton_impl as ti
    n = blocks.shape[-1]
    union, count, _ = ti.tile_block_union(blocks, queries, triton.cdiv(T, sel_block))
    o = torch.empty_like(q)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    if fill is not None:
        o.fill_(fill)
        lse.fill_(fill)
    selected_shared_fwd_kernel[(union.shape[1], B * G)](
        q, _desc(k.view(B * T, G * D), [sel_block, D]), _desc(v.view(B * T, G * D), [sel_block, D]), blocks, union,
        count, o, lse, T, union.shape[1], scale * LOG2E, H=H, G=G, D=D, SEL_BLOCK=sel_block, N_SELECT=n,
        N_PAD=triton.next_power_of_2(n), QUERIES=queries, STAGES=stages, WORKER_REGS=worker_regs, PROBE=probe,
        num_warps=4,
        **(dict(maxnreg=maxnreg) if maxnreg else {}))
    return o, lse


def _tl_forward(q, k, v, blocks, scale: float, sel_block: int, kernel: str):
    """The production forward of the selected branch under slc_kernel = kernel ("tiled" or "per_query"): its
    union build (tiled) and its kernel, as the core launches them."""
    from nsa_model.ops import triton_impl as ti
    with ti.use_launch_config(dataclasses.replace(ti.launch_config(), slc_kernel=kernel)):
        o, lse, ran, _ = ti._selected_fwd(q, k, v, blocks, sel_block, scale)
    assert ran == kernel, (ran, kernel)
    return o, lse


SHAPES = {"paper_1x8k": (1, 8192, 64, 4, 128), "paper_1x16k": (1, 16384, 64, 4, 128),
          "paper_1x64k": (1, 65536, 64, 4, 128)}
VARIANTS = [  # (queries a tile, stages, registers a query warp, the kernel's register cap). The loader partition
    # is 4 warps (a warp-specialized kernel's default partition is a multiple of 4) and gives its registers to the
    # query warps (setmaxnreg): 4 queries at a cap of 128 run 2 programs a multiprocessor, 8 at 168 one.
    (4, 3, 216, 128), (4, 2, 216, 128), (4, 4, 216, 128), (8, 3, 232, 168), (8, 2, 232, 168), (4, 3, 232, None),
]


def _inputs(B, T, H, G, D, cfg):
    """Random q, k, v (bf16) and NSA's own selection over random compressed keys, as the by_block spike."""
    from nsa_model.ops import triton_impl as ti
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, n, D, device="cuda", generator=gen).to(torch.bfloat16) for n in (H, G, G))
    scale = 1.0 / math.sqrt(D)
    kc = torch.randn(B, (T - cfg.cmp_block) // cfg.cmp_stride + 1, G, D, device="cuda", generator=gen)
    kc = kc.to(torch.bfloat16)
    _, lse_c = ti._range_fwd(q, kc, kc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
    return q, k, v, ti.select_blocks(q, kc, lse_c, cfg, scale), scale


def _profile_once(q, k, v, blocks, scale: float, sel_block: int) -> None:
    """One launch of each kernel under the profiler, after a warm-up launch of each (the compiles)."""
    queries, stages, regs, cap = VARIANTS[0]
    runs = [lambda: _tl_forward(q, k, v, blocks, scale, sel_block, "tiled")]
    runs += [lambda probe=probe: selected_shared_fwd(q, k, v, blocks, scale, sel_block, queries, stages, regs, cap,
                                                     probe=probe) for probe in (0, 1, 2)]
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="", help="commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    ap.add_argument("--profile", action="store_true",
                    help="no checks or timings: one launch each of the tl tiled forward, the first variant and its "
                         "two probes between cudaProfilerStart and Stop (ncu --profile-from-start off)")
    args = ap.parse_args()
    from nsa_model.config import NSAConfig
    os.makedirs(args.out, exist_ok=True)
    cfg = NSAConfig()
    rows_out = []
    for name in args.shapes.split(","):
        B, T, H, G, D = SHAPES[name]
        q, k, v, blocks, scale = _inputs(B, T, H, G, D, cfg)
        if args.profile:
            _profile_once(q, k, v, blocks, scale, cfg.sel_block)
            continue
        o_ref, l_ref = _tl_forward(q, k, v, blocks, scale, cfg.sel_block, "tiled")
        row = dict(shape=name, B=B, T=T, H=H, G=G, D=D, variants=[])
        for kernel in ("tiled", "per_query"):
            run = lambda: _tl_forward(q, k, v, blocks, scale, cfg.sel_block, kernel)  # noqa: E731
            triton.testing.do_bench(run, warmup=25, rep=100)  # clocks up before the baseline
            row[f"{kernel}_ms"] = triton.testing.do_bench(run, warmup=25, rep=200)
            print(name, kernel, round(row[f"{kernel}_ms"], 4), flush=True)
        finite = torch.isfinite(l_ref)
        for queries, stages, regs, cap in VARIANTS:
            entry = dict(queries=queries, stages=stages, worker_regs=regs, maxnreg=cap)
            try:
                o, lse = selected_shared_fwd(q, k, v, blocks, scale, cfg.sel_block, queries, stages, regs, cap,
                                             fill=float("nan"))
                torch.cuda.synchronize()
                entry["same_empty"] = bool(torch.equal(torch.isfinite(lse), finite))
                entry["nan_left"] = int(torch.isnan(lse).sum() + torch.isnan(o).sum())
                entry["o_err"] = float((o[finite].float() - o_ref[finite].float()).abs().max())
                entry["lse_err"] = float((lse[finite] - l_ref[finite]).abs().max())
                run = lambda: selected_shared_fwd(q, k, v, blocks, scale, cfg.sel_block, queries,  # noqa: E731
                                                  stages, regs, cap)
                ms = triton.testing.do_bench(run, warmup=25, rep=200)
                entry.update(ms=ms, vs_tiled=row["tiled_ms"] / ms, vs_per_query=row["per_query_ms"] / ms)
            except Exception as exc:  # a variant that fails to compile or run is a result of the spike
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["variants"].append(entry)
            print(name, entry, flush=True)
        queries, stages, regs, cap = VARIANTS[0]
        for probe in (1, 2):  # where the first variant's time goes: its work without the skips, its skeleton alone
            run = lambda: selected_shared_fwd(q, k, v, blocks, scale, cfg.sel_block, queries, stages,  # noqa: E731
                                              regs, cap, probe=probe)
            row[f"probe{probe}_ms"] = triton.testing.do_bench(run, warmup=25, rep=200)
            print(name, f"probe {probe}", round(row[f"probe{probe}_ms"], 4), flush=True)
        rows_out.append(row)
    if args.profile:
        return 0
    stem, meta = result_stem(args.out, "gluon-selected-fwd", args.suffix, args.commit or git_commit())
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows_out))
    print(report(meta, rows_out))
    return 0


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl forwards (tiled, per query), then each Gluon variant: time, ratios, errors against tiled."""
    lines = [f"# Selected forward, one warp per query over a tile's shared block loads (Gluon spike): "
             f"{meta['device']}, {meta['date'][:16]} UTC", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, bf16, selections from random "
             "inputs through NSA's own selection, median of triton.testing.do_bench; each forward's time includes "
             "its union build. vs > 1: the Gluon kernel is faster. Its outputs start as NaN; empty: the same "
             "queries' lse -inf as the tl tiled kernel's; NaN left: entries never written; errors: max abs "
             "difference from the tiled kernel's o and lse where its lse is finite.", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl tiled: {r['tiled_ms']:.3f} ms; tl per query: {r['per_query_ms']:.3f} ms", "",
                  *([f"Timing probes of the first variant (wrong values): every query warp computing on every block "
                     f"{r['probe1_ms']:.3f} ms; none computing (the loader, the barriers and the union walk) "
                     f"{r['probe2_ms']:.3f} ms", ""] if "probe1_ms" in r else []),
                  "| queries a tile | stages | registers a query warp | register cap | ms | vs tiled | vs per query "
                  "| empty, NaN left | o err | lse err |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in r["variants"]:
            head = f"| {e['queries']} | {e['stages']} | {e['worker_regs']} | {e['maxnreg'] or '-'} |"
            if "error" in e:
                lines.append(f"{head} {e['error']} | | | | | |")
            else:
                lines.append(f"{head} {e['ms']:.3f} | {e['vs_tiled']:.3f} | {e['vs_per_query']:.3f} | "
                             f"{e['same_empty']}, {e['nan_left']} | {e['o_err']:.2g} | {e['lse_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
