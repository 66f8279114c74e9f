"""A spike: by_block's forward as a warp-specialized Gluon kernel, against the tl kernel, same run.

Why (kernels-notes.md v30, part 3). At 125m 4 x 8k by_block's two kernels take 1.57 ms of the core's 3.52. Their
q (and do) rows are a gather, 16 per query, and v22's counters put them at 82-84% L2 hits, 30-43% of DRAM,
15-25% matrix busy, stalled on the long scoreboard: latency with too little in flight, not bandwidth. The tl
kernel prefetches one step ahead in registers (v24). Here one warp does nothing but gather: it copies each step's
chooser rows into a ring of shared-memory slots with asynchronous copies (cp.async: Hopper's TMA does not gather),
STAGES steps ahead of the four math warps, which take a slot when its barrier says it is full and free it when
their QK^T has read it (FlashAttention-3's producer / consumer split, without its ping-pong).

Same work list, index and outputs as the tl kernel (kernels/selected_by_block.py, `selected_block_fwd_kernel`):
per (query, slot) the softmax over block j's visible keys (o normalized, in the input dtype) and its log2-sum-exp.
Head dim 64, 64 rows a step (10 choosers of a 6-head group), as nsa-125m's defaults.

Outcome on the H100 (bench/results/gluon-by-block-fwd-h100-2026-11-25-v30*.md, kernels-notes.md v30 part 4):
every variant writes the tl kernel's partials bit for bit. The first one was 1.6x slower: its stores went out
of the matrix unit's register layout, 4 bytes a thread. Stored 16 bytes a thread it ties the tl kernel
(0.99-1.04x), and issuing the next step's QK^T before this step's softmax gives 1.03-1.06x. How far ahead the
gathers run (copies waited for up to 5 steps late, 2-6 slots) changes nothing. So the gather's latency is not
what bounds this kernel either, and the tl kernel, with its one-step register prefetch, is within 5% of the
hand-scheduled one. The tl kernels stay.

Since v41-v42 the tl kernel scales its partial rows by a reciprocal and its scores inside the exponential's FMA;
this spike keeps v30's arithmetic, so its o_err and lse_err against the tl kernel are now rounding-sized, not 0.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_by_block_fwd.py --out DIR (checks each variant's partials against
the tl kernel's, then times both).
"""

import argparse
import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.provenance import file_suffix, git_commit, result_file, result_stem

LOG2E = 1.4426950408889634


@gluon.jit
def _work(WORK_SEG, WORK_CHUNK, STARTS, num_blocks, G: gl.constexpr, CHUNK: gl.constexpr):
    """(segment, b, g, block j, first entry, end entry) of this program, as the tl kernel's _work_item."""
    pid = gl.program_id(0)
    seg = gl.load(WORK_SEG + pid)
    seg_c = gl.maximum(seg, 0)
    chunk = gl.load(WORK_CHUNK + pid)
    start = gl.load(STARTS + seg_c) + chunk * CHUNK
    end = gl.minimum(gl.load(STARTS + seg_c + 1), start + CHUNK)
    end = gl.where(seg >= 0, end, start)  # a spare program: no steps
    bg = seg_c // num_blocks
    return bg // G, bg % G, seg_c % num_blocks, start, end


@gluon.jit
def _gather_step(Q, ORDER, q_ring, flat_ring, s, e0, end, r, d, head, g, H: gl.constexpr, G: gl.constexpr,
                 D: gl.constexpr, N_SELECT: gl.constexpr, ROWS: gl.constexpr):
    """Issue one step's copies: the chooser rows of q into slot s (asynchronous), their flat slots beside them."""
    HPG: gl.constexpr = H // G
    ENTRIES: gl.constexpr = ROWS // HPG
    e = e0 + r // HPG
    ok = (r < ENTRIES * HPG) & (e < end)
    flat = gl.load(ORDER + e, mask=ok, other=0)
    row_q = (flat // (G * N_SELECT)).to(gl.int64) * H + (g * HPG + head)
    async_copy.async_copy_global_to_shared(q_ring.index(s), Q + gl.expand_dims(row_q, 1) * D
                                           + gl.expand_dims(d, 0), mask=gl.expand_dims(ok, 1))
    flat_ring.index(s).store(flat)
    async_copy.commit_group()


@gluon.jit
def _publish(ready, s):
    """Step in slot s is in (the caller waited for its copy group): make it visible, then one arrive."""
    fence_async_shared()  # the copies (generic proxy) before the consumer's matrix unit (async proxy) reads
    gl.thread_barrier()  # every gather warp's copies and stores are in before the one arrive
    mbarrier.arrive(ready.index(s), count=1)


@gluon.jit
def _producer(Q, ORDER, q_ring, flat_ring, ready, empty, start, end, b, g, T,
              H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, N_SELECT: gl.constexpr, ROWS: gl.constexpr,
              STAGES: gl.constexpr, LAG: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """The gather warp(s): step i's chooser rows of q into slot i % STAGES, and their flat slots beside them. With
    LAG > 0 a step's copies are waited for only LAG steps later, so up to LAG + 1 gathers are in flight."""
    HPG: gl.constexpr = H // G
    ENTRIES: gl.constexpr = ROWS // HPG
    gl.static_assert(LAG < STAGES, "a step is published before its slot comes round again")
    rows_2d: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                             warps_per_cta=[PRODUCER_WARPS, 1], order=[1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, rows_2d))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, rows_2d))
    head = r % HPG
    n_steps = gl.cdiv(end - start, ENTRIES)
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh slot passes: phase 1 counts as done
        _gather_step(Q, ORDER, q_ring, flat_ring, s, start + i * ENTRIES, end, r, d, head, g, H, G, D, N_SELECT,
                     ROWS)
        if i >= LAG:
            async_copy.wait_group(LAG)
            _publish(ready, (i - LAG) % STAGES)
    async_copy.wait_group(0)
    for i in range(gl.maximum(n_steps - LAG, 0), n_steps):
        _publish(ready, i % STAGES)


@gluon.jit
def _softmax_rows(s, pos, t, qk_scale, MASKED: gl.constexpr):
    s = s * qk_scale
    if MASKED:
        s = gl.where(gl.expand_dims(pos, 0) <= gl.expand_dims(t, 1), s, float("-inf"))
    m = gl.max(s, axis=1)
    m_safe = gl.where(m == float("-inf"), 0.0, m)  # a chooser that sees none of the block
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    return p, m_safe, gl.sum(p, axis=1)


@gluon.jit
def _finish_step(scores, flat, i, start, end, b, j, T, qk_scale, pos, r, head, d_o, v_smem, o_zero, O_PART, LSE2_PART,
                 H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr, N_SELECT: gl.constexpr,
                 ROWS: gl.constexpr, WHOLE_CHECK: gl.constexpr, COALESCED: gl.constexpr, num_warps: gl.constexpr):
    """Step i after its scores: the block's softmax, P V, the partial o and lse of each chooser row stored."""
    HPG: gl.constexpr = H // G
    ENTRIES: gl.constexpr = ROWS // HPG
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    store_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                  warps_per_cta=[num_warps, 1], order=[1, 0])
    e = start + i * ENTRIES + r // HPG
    ok = (r < ENTRIES * HPG) & (e < end)
    t = flat // (G * N_SELECT) - b * T
    if WHOLE_CHECK:
        if gl.min(gl.where(ok, t, T), axis=0) >= (j + 1) * SEL_BLOCK - 1:  # every chooser sees the whole block
            p, m_safe, l_i = _softmax_rows(scores, pos, t, qk_scale, False)
        else:
            p, m_safe, l_i = _softmax_rows(scores, pos, t, qk_scale, True)
    else:  # the mask on every step: no cross-warp reduction for the check
        p, m_safe, l_i = _softmax_rows(scores, pos, t, qk_scale, True)
    acc = warpgroup_mma(gl.convert_layout(p.to(v_smem.dtype), p_layout), v_smem, o_zero, use_acc=False)
    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    row_p = flat.to(gl.int64) * HPG + head
    gl.store(LSE2_PART + row_p, gl.where(has_key, m_safe + gl.log2(l_safe), float("-inf")), mask=ok)
    o = (acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)).to(O_PART.dtype.element_ty)
    if COALESCED:  # each thread stores 16 bytes of a row instead of the MMA layout's 4
        o = gl.convert_layout(o, store_layout)
        row_st = gl.convert_layout(row_p, gl.SliceLayout(1, store_layout))
        ok_st = gl.convert_layout(ok, gl.SliceLayout(1, store_layout))
        d_st = gl.arange(0, D, layout=gl.SliceLayout(0, store_layout))
        gl.store(O_PART + gl.expand_dims(row_st, 1) * D + gl.expand_dims(d_st, 0), o,
                 mask=gl.expand_dims(ok_st, 1) & gl.expand_dims(d_st < D, 0))
    else:
        row_po = gl.convert_layout(row_p, rows_o)
        ok_o = gl.convert_layout(ok, rows_o)
        gl.store(O_PART + gl.expand_dims(row_po, 1) * D + gl.expand_dims(d_o, 0), o,
                 mask=gl.expand_dims(ok_o, 1) & gl.expand_dims(d_o < D, 0))


@gluon.jit
def _block_setup(k_desc, v_desc, b, g, j, T, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                 SEL_BLOCK: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """The math warps' start: block j's keys and values in shared memory (TMA, waited for), and the per-step
    constants: key positions, row ids, heads, head-dim ids, zero accumulators."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, SEL_BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [SEL_BLOCK, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [SEL_BLOCK, D], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b * T + j * SEL_BLOCK, g * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b * T + j * SEL_BLOCK, g * D], kv_bar, v_smem)
    mbarrier.wait(kv_bar, 0)
    mbarrier.invalidate(kv_bar)

    pos = j * SEL_BLOCK + gl.arange(0, SEL_BLOCK, layout=gl.SliceLayout(0, s_layout))
    r = gl.arange(0, ROWS, layout=rows_s)
    head = r % (H // G)
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    s_zero = gl.zeros([ROWS, SEL_BLOCK], gl.float32, layout=s_layout)
    o_zero = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    return k_smem, v_smem, pos, r, head, d_o, s_zero, o_zero


@gluon.jit
def _consumer(k_desc, v_desc, O_PART, LSE2_PART, q_ring, flat_ring, ready, empty, start, end, b, g, j, T,
              qk_scale, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr,
              N_SELECT: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, WHOLE_CHECK: gl.constexpr,
              COALESCED: gl.constexpr, num_warps: gl.constexpr):
    """The math warps: block j's keys and values once (TMA), then per step S = q K^T, the block's softmax, P V."""
    ENTRIES: gl.constexpr = ROWS // (H // G)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, SEL_BLOCK, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_smem, v_smem, pos, r, head, d_o, s_zero, o_zero = _block_setup(k_desc, v_desc, b, g, j, T, H, G, D, SEL_BLOCK,
                                                                     ROWS, num_warps)
    n_steps = gl.cdiv(end - start, ENTRIES)
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        fence_async_shared()  # the gathered rows (generic proxy) before the matrix unit reads them
        tok = warpgroup_mma(q_ring.index(s), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        flat = flat_ring.index(s).load(rows_s)
        scores = warpgroup_mma_wait(0, deps=(tok, ))
        mbarrier.arrive(empty.index(s), count=1)
        _finish_step(scores, flat, i, start, end, b, j, T, qk_scale, pos, r, head, d_o, v_smem, o_zero, O_PART,
                     LSE2_PART, H, G, D, SEL_BLOCK, N_SELECT, ROWS, WHOLE_CHECK, COALESCED, num_warps)


@gluon.jit
def _consumer_overlap(k_desc, v_desc, O_PART, LSE2_PART, q_ring, flat_ring, ready, empty, start, end, b, g, j, T,
                      qk_scale, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr,
                      N_SELECT: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, WHOLE_CHECK: gl.constexpr,
                      COALESCED: gl.constexpr, num_warps: gl.constexpr):
    """_consumer with the next step's QK^T issued before this step's softmax, so the matrix unit works under it."""
    ENTRIES: gl.constexpr = ROWS // (H // G)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, SEL_BLOCK, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_smem, v_smem, pos, r, head, d_o, s_zero, o_zero = _block_setup(k_desc, v_desc, b, g, j, T, H, G, D, SEL_BLOCK,
                                                                     ROWS, num_warps)
    n_steps = gl.cdiv(end - start, ENTRIES)
    if n_steps > 0:
        mbarrier.wait(ready.index(0), 0)
        fence_async_shared()
        tok = warpgroup_mma(q_ring.index(0), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        flat = flat_ring.index(0).load(rows_s)
        scores = warpgroup_mma_wait(0, deps=(tok, ))
        mbarrier.arrive(empty.index(0), count=1)
        for i in range(n_steps - 1):
            sn = (i + 1) % STAGES
            mbarrier.wait(ready.index(sn), ((i + 1) // STAGES) & 1)
            fence_async_shared()
            tok = warpgroup_mma(q_ring.index(sn), k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _finish_step(scores, flat, i, start, end, b, j, T, qk_scale, pos, r, head, d_o, v_smem, o_zero, O_PART,
                         LSE2_PART, H, G, D, SEL_BLOCK, N_SELECT, ROWS, WHOLE_CHECK, COALESCED, num_warps)
            flat = flat_ring.index(sn).load(rows_s)
            scores = warpgroup_mma_wait(0, deps=(tok, ))
            mbarrier.arrive(empty.index(sn), count=1)
        _finish_step(scores, flat, n_steps - 1, start, end, b, j, T, qk_scale, pos, r, head, d_o, v_smem, o_zero,
                     O_PART, LSE2_PART, H, G, D, SEL_BLOCK, N_SELECT, ROWS, WHOLE_CHECK, COALESCED, num_warps)


@gluon.jit
def by_block_fwd_ws_kernel(Q, k_desc, v_desc, ORDER, STARTS, WORK_SEG, WORK_CHUNK, O_PART, LSE2_PART, T, num_blocks,
                           qk_scale, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, SEL_BLOCK: gl.constexpr,
                           N_SELECT: gl.constexpr, ROWS: gl.constexpr, CHUNK: gl.constexpr, STAGES: gl.constexpr,
                           LAG: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           WHOLE_CHECK: gl.constexpr, COALESCED: gl.constexpr, OVERLAP: gl.constexpr,
                           num_warps: gl.constexpr):
    b, g, j, start, end = _work(WORK_SEG, WORK_CHUNK, STARTS, num_blocks, G, CHUNK)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)
    q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, D], q_layout)
    flat_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    flat_ring = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], flat_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer_overlap if OVERLAP else _consumer,
         (k_desc, v_desc, O_PART, LSE2_PART, q_ring, flat_ring, ready, empty, start, end, b, g, j, T, qk_scale, H, G, D,
          SEL_BLOCK, N_SELECT, ROWS, STAGES, WHOLE_CHECK, COALESCED, num_warps)),
        (_producer, (Q, ORDER, q_ring, flat_ring, ready, empty, start, end, b, g, T, H, G, D, N_SELECT, ROWS, STAGES,
                     LAG, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])


def _desc(x2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), block, layout)


def by_block_fwd_ws(q, k, v, index, scale: float, n_select: int, sel_block: int = 64, chunk: int = 512,
                    stages: int = 3, producer_warps: int = 1, producer_regs: int = 48, maxnreg: int = 128,
                    lag: int = 0, whole_check: bool = True, coalesced: bool = False, overlap: bool = False,
                    fill: float | None = None):
    """(o_part, lse2_part) of the by_block forward over `index` (ops._by_block_index): q [B, T, H, 64], k and v
    [B, T, G, 64] contiguous bf16. fill: the outputs start as this value (NaN for a check: a slot the kernel
    misses cannot pass for a stale copy of an earlier call's result)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    if D != 64 or T % sel_block:
        raise ValueError(f"the spike takes head dim 64 and T a multiple of {sel_block}; got D={D}, T={T}")
    order, starts, work_seg, work_chunk = index
    slots = B * T * G * n_select * (H // G)
    o_part = torch.empty(slots, D, dtype=q.dtype, device=q.device)
    lse2_part = torch.empty(slots, dtype=torch.float32, device=q.device)
    if fill is not None:
        o_part.fill_(fill)
        lse2_part.fill_(fill)
    by_block_fwd_ws_kernel[(work_seg.numel(), )](
        q, _desc(k.view(B * T, G * D), [sel_block, D]), _desc(v.view(B * T, G * D), [sel_block, D]), order, starts,
        work_seg, work_chunk, o_part, lse2_part, T, triton.cdiv(T, sel_block), scale * LOG2E, H=H, G=G, D=D,
        SEL_BLOCK=sel_block, N_SELECT=n_select, ROWS=64, CHUNK=chunk, STAGES=stages, LAG=lag,
        PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, WHOLE_CHECK=whole_check, COALESCED=coalesced,
        OVERLAP=overlap, num_warps=4, maxnreg=maxnreg)
    return o_part, lse2_part


def _tl_partials(q, k, v, blocks, index, scale, sel_block, fill: float | None = None):
    """The tl kernel's partials, launched as ops/triton_impl.py's _selected_by_block_fwd does (without the combine)."""
    from nsa_model.kernels.selected_by_block import selected_block_fwd_kernel
    from nsa_model.ops import triton_impl as ti
    B, T, H, D = q.shape
    G, n = k.shape[2], blocks.shape[-1]
    c = ti.launch_config()
    common = dict(H=H, G=G, SEL_BLOCK=sel_block, BLOCK_S=ti._pow2(sel_block), N_SELECT=n, **ti._head_dims(q, v),
                  **ti._kv_strides(k, v))
    order, starts, work_seg, work_chunk = index
    slots = B * T * G * n * (H // G)
    o_part = torch.empty(slots, D, dtype=q.dtype, device=q.device)
    lse2_part = torch.empty(slots, dtype=torch.float32, device=q.device)
    if fill is not None:
        o_part.fill_(fill)
        lse2_part.fill_(fill)
    rows = ti._block_rows(H // G, c)
    prefetch = ti._block_prefetch(q, v)
    selected_block_fwd_kernel[(work_seg.numel(), )](
        q, k, v, ORDER=order, STARTS=starts, WORK_SEG=work_seg, WORK_CHUNK=work_chunk, O_PART=o_part,
        LSE2_PART=lse2_part, T=T, num_blocks=triton.cdiv(T, sel_block), scale=scale, ROWS=rows,
        CHUNK=c.slc_block_chunk, PREFETCH=prefetch, OFFSETS_64=ti._offsets_64(q, k, v, o_part), **common,
        num_warps=c.slc_block_warps,
        num_stages=c.slc_block_stages, **(dict(maxnreg=c.slc_block_fwd_maxnreg) if prefetch else {}),
        **ti._block_tiles(rows, common, k, v))
    return o_part, lse2_part


SHAPES = {"125m_4x8k": (4, 8192, 12, 2, 64), "125m_16x2k": (16, 2048, 12, 2, 64), "125m_1x32k": (1, 32768, 12, 2, 64)}
VARIANTS = [  # (stages, gather warps, their registers, the kernel's register cap (128: 2 programs a
    # multiprocessor, 80: 3), steps a copy group is waited for late, the whole-block check, 16-byte stores,
    # the next step's QK^T under this step's softmax)
    (4, 4, 48, 128, 2, True, False, False), (4, 4, 48, 128, 2, False, True, False),
    (4, 4, 48, 96, 2, False, True, False), (4, 4, 48, 128, 2, False, True, True), (4, 4, 48, 112, 2, False, True, True),
    (6, 4, 48, 128, 3, False, True, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="", help="commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--suffix", type=file_suffix, default="")
    args = ap.parse_args()
    from nsa_model.config import NSAConfig
    from nsa_model.ops import triton_impl as ti
    os.makedirs(args.out, exist_ok=True)
    cfg = NSAConfig()
    rows_out = []
    for name, (B, T, H, G, D) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, n, D, device="cuda", generator=gen).to(torch.bfloat16) for n in (H, G, G))
        scale = 1.0 / math.sqrt(D)
        kc = torch.randn(B, (T - cfg.cmp_block) // cfg.cmp_stride + 1, G, D, device="cuda", generator=gen)
        kc = kc.to(torch.bfloat16)
        _, lse_c = ti._range_fwd(q, kc, kc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
        blocks = ti.select_blocks(q, kc, lse_c, cfg, scale)
        index = ti._by_block_index(blocks, cfg.sel_block, ti.launch_config())
        o_ref, l_ref = _tl_partials(q, k, v, blocks, index, scale, cfg.sel_block, fill=float("nan"))
        run_tl = lambda: _tl_partials(q, k, v, blocks, index, scale, cfg.sel_block)  # noqa: E731
        triton.testing.do_bench(run_tl, warmup=50, rep=200)  # clocks up before the baseline
        t_ref = triton.testing.do_bench(run_tl, warmup=50, rep=300)
        # slots a query filled: the kernels write every slot with an entry, -inf where its block is after t
        valid = ~torch.isnan(l_ref)
        row = dict(shape=name, B=B, T=T, H=H, G=G, D=D, tl_ms=t_ref, variants=[])
        print(name, "tl", round(t_ref, 4), flush=True)
        for stages, pw, pr, mr, lag, whole, coal, ov in VARIANTS:
            entry = dict(stages=stages, producer_warps=pw, producer_regs=pr, maxnreg=mr, lag=lag, whole_check=whole,
                         coalesced=coal, overlap=ov)
            run = lambda: by_block_fwd_ws(q, k, v, index, scale, cfg.n_selected, cfg.sel_block,  # noqa: E731
                                          ti.launch_config().slc_block_chunk, stages, pw, pr, mr, lag, whole, coal,
                                          ov)
            try:
                o, lse2 = by_block_fwd_ws(q, k, v, index, scale, cfg.n_selected, cfg.sel_block,
                                          ti.launch_config().slc_block_chunk, stages, pw, pr, mr, lag, whole, coal, ov,
                                          fill=float("nan"))
                torch.cuda.synchronize()
                filled = valid.nonzero().squeeze(1)
                finite = torch.isfinite(l_ref[filled])
                entry["slots"] = int(filled.numel())
                entry["same_written"] = bool(torch.equal(torch.isnan(lse2), torch.isnan(l_ref)))
                entry["same_empty"] = bool(torch.equal(torch.isinf(lse2[filled]), ~finite))
                keep = filled[finite]
                entry["o_err"] = float((o[keep].float() - o_ref[keep].float()).abs().max())
                entry["lse_err"] = float((lse2[keep] - l_ref[keep]).abs().max())
                ms = triton.testing.do_bench(run, warmup=50, rep=300)
                entry.update(ms=ms, vs_tl=t_ref / ms)
            except Exception as exc:  # a variant that fails to compile or run is a result of the spike
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row["variants"].append(entry)
            print(name, entry, flush=True)
        rows_out.append(row)
    stem, meta = result_stem(args.out, "gluon-by-block-fwd", args.suffix, args.commit or git_commit())
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows_out))
    print(report(meta, rows_out))
    return 0


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl kernel, then each warp-specialized variant: time, ratio to tl, errors against tl."""
    lines = [f"# by_block forward, warp-specialized Gluon spike against the tl kernel: {meta['device']}, "
             f"{meta['date'][:16]} UTC", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, bf16, selections from random "
             "inputs through NSA's own selection, median of triton.testing.do_bench. vs tl > 1: the Gluon kernel is "
             "faster. Both kernels' outputs start as NaN; written: the same slots written by both; empty: the same "
             "slots -inf (a block after the query); errors: max abs difference from the tl kernel's partials over "
             "the others.", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl `selected_block_fwd_kernel`: {r['tl_ms']:.3f} ms", "",
                  "| stages | gather warps | their registers | register cap | copies waited late by | whole-block "
                  "check | 16-byte stores | next QK^T early | ms | vs tl | written, empty | o err | lse err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in r["variants"]:
            head = (f"| {e['stages']} | {e['producer_warps']} | {e['producer_regs']} | {e['maxnreg']} | "
                    f"{e.get('lag', 0)} | {e.get('whole_check', True)} | {e.get('coalesced', False)} | "
                    f"{e.get('overlap', False)} |")
            if "error" in e:
                lines.append(f"{head} {e['error']} | | | | |")
            else:
                same = f"{e.get('same_written', '-')}, {e.get('same_empty', '-')}"
                lines.append(f"{head} {e['ms']:.3f} | {e['vs_tl']:.3f} | {same} | {e['o_err']:.2g} | "
                             f"{e['lse_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
