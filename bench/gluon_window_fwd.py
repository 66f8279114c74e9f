"""A spike: the window branch's forward as a Gluon kernel, against our Triton (tl) range forward, same run.

Why. Since v22 (bench/results/kernels-notes.md) the attention kernels are latency-bound: the matrix units sit
idle while a tile's softmax runs, because the tl compiler issues a tile's QK^T, waits, runs the softmax, issues
PV and waits again. FlashAttention-3 overlaps them inside one warpgroup: the next tile's QK^T and the previous
tile's PV run on the tensor cores while this tile's softmax runs on the ALUs. tl gives no handle on that order.
Gluon (Triton's lower-level dialect, in Triton 3.6) does: explicit asynchronous wgmma with waits placed by hand,
TMA copies into a ring of shared-memory slots with mbarriers. This script asks whether that order pays, on the
simplest of our ranges (the window branch: query t sees keys t - w + 1 .. t), before any production kernel moves.

Schedule of one program (a query tile of one head), tile j of its keys:

    issue S_j = Q K_j^T                (async)
    issue acc += P_{j-1} V_{j-1}       (async)
    wait until S_j is done             (in-order completion: one group may stay in flight, PV_{j-1})
    softmax of S_j -> P_j, alpha_j     (overlaps PV_{j-1} on the tensor cores)
    wait until PV_{j-1} is done; its K/V slot is free: start the copy of tile j - 1 + STAGES into it
    acc *= alpha_j

Two more questions ride along: EXP (is the exponential unit, the MUFU, what bounds the loop? a probe with no
exponential at all, and FlashAttention-4's polynomial 2^x on the FMA units) and window_fwd_persistent_kernel (a
few programs per multiprocessor walking many query tiles, the next tile's q and K/V copied while this one
computes: does a short range pay its loads' latency?).

Outcome on the H100 (bench/results/gluon-window-fwd-h100-2026-11-25-v30*.md, kernels-notes.md v30): every
variant matches the tl kernel (o within 2e-3, lse within 1e-6), and none is faster by more than the spread:
the best per shape is 1.01-1.06x tl. Without any exponential the loop is at most 11% faster (the MUFU does not
bound it); the polynomial is slower (15-27%). The FLOP rate rises with the range's length in both kernels (125m 4 x 8k:
285 TFLOP/s at w = 512, 380 at 2048, 397 at 4096, against cuDNN's 440), and the persistent form does not
recover the short range's loss (0.67-1.04x tl). The tl kernels stay; this file stays as the measurement.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_window_fwd.py --out DIR [--window W] [--suffix S] (checks each
variant against the tl kernel, then times them; results as JSON and markdown).
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
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.provenance import file_suffix, git_commit, result_file, result_stem

LOG2E = 1.4426950408889634


@gluon.jit
def _exp2_poly(x):
    """2^x on the FMA units instead of the MUFU (FlashAttention-4's trick): 2^floor(x) from the exponent bits
    times a degree-3 fit of 2^f on [0, 1) (relative error 1.0e-4, below bf16's 3.9e-3)."""
    xc = gl.maximum(x, -126.0)
    xi = gl.floor(xc)
    f = xc - xi
    p = (((0.0790857 * f + 0.22451634) * f + 0.69639055) * f + 0.99989669)
    y = (p.to(gl.int32, bitcast=True) + (xi.to(gl.int32) << 23)).to(gl.float32, bitcast=True)
    return gl.where(x < -126.0, 0.0, y)


@gluon.jit
def _exp2(x, EXP: gl.constexpr):
    """EXP 0: the MUFU's exp2; 1: no exponential at all (wrong values: a timing probe of the MUFU's share);
    2: _exp2_poly."""
    if EXP == 0:
        y = gl.exp2(x)
    elif EXP == 1:
        y = x
    else:
        y = _exp2_poly(x)
    return y


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, window, MASKED: gl.constexpr, EXP: gl.constexpr):
    """P (fp32) of one score tile, the new running max and sum, and alpha = exp2(m_old - m_new)."""
    s = s * qk_scale
    if MASKED:
        rel = gl.expand_dims(offs_m, 1) - gl.expand_dims(offs_n, 0)
        s = gl.where((rel >= 0) & (rel < window), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay zeros
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = m_new
    p = _exp2(s - gl.expand_dims(m_safe, 1), EXP)
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, window, start_n, mid_lo, mid_hi, EXP: gl.constexpr):
    """_softmax_tile with the visibility mask only where the tile is not seen whole by every query."""
    if (start_n < mid_lo) | (start_n >= mid_hi):
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, window, True, EXP)
    else:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, window, False, EXP)
    return p, m_new, l_new, alpha


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bar, row, col, pred):
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_smem, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_smem, pred=pred)


@gluon.jit
def _item_range(item, n_m, T, window, H: gl.constexpr, G: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
    """(b, h, g, t_first, lo, mid_lo, mid_hi, n_tiles) of work item = bh * n_m + query tile (reversed: a tile
    of the grid's first axis counted from the end, as the tl kernels). Keys [lo, hi); the tiles of [mid_lo, mid_hi)
    are seen whole by every query of the tile (the tl kernel's masked / full / masked split)."""
    pid_m = n_m - 1 - item % n_m
    bh = item // n_m
    b = bh // H
    h = bh % H
    g = h // (H // G)
    t_first = pid_m * BLOCK_M
    t_last = gl.minimum(t_first + BLOCK_M, T) - 1
    hi = gl.minimum(t_last + 1, T)
    lo = gl.maximum(t_first - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_hi = gl.minimum(t_first + 1, hi)
    full_lo = gl.maximum(t_last - window + 1, 0)
    mid_lo = gl.minimum(lo + gl.cdiv(gl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
    mid_hi = mid_lo + (gl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
    return b, h, g, t_first, lo, mid_lo, mid_hi, gl.cdiv(hi - lo, BLOCK_N)


@gluon.jit
def window_fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, T, qk_scale, window,
                      H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                      EXP: gl.constexpr, num_warps: gl.constexpr):
    n_m = gl.num_programs(0)
    b, h, g, t_first, lo, mid_lo, mid_hi, n_tiles = _item_range(gl.program_id(1) * n_m + gl.program_id(0), n_m, T,
                                                                window, H, G, BLOCK_M, BLOCK_N)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    fence_async_shared()

    kv_row = b * T + lo
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * T + t_first, h * D], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem.index(i), v_smem.index(i), kv_bar.index(i), kv_row + i * BLOCK_N, g * D,
                 i < n_tiles)

    offs_m = t_first + gl.arange(0, BLOCK_M, layout=rows_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # tile 0: its scores and softmax only (the window branch sees at least one tile)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(kv_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    offs_n = lo + gl.arange(0, BLOCK_N, layout=cols_s)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, window, True, EXP)
    p_prev = gl.convert_layout(p.to(q_desc.dtype), p_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(kv_bar.index(slot), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
        start_n = lo + j * BLOCK_N
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=cols_s)
        if OVERLAP:  # the softmax runs while PV_{j-1} is on the tensor cores
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, window, start_n, mid_lo,
                                               mid_hi, EXP)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        else:  # tl's order: everything done before the softmax starts
            s, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, window, start_n, mid_lo,
                                               mid_hi, EXP)
        nxt = j - 1 + STAGES
        _load_kv(k_desc, v_desc, k_smem.index(prev), v_smem.index(prev), kv_bar.index(prev),
                 kv_row + nxt * BLOCK_N, g * D, nxt < n_tiles)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
        p_prev = gl.convert_layout(p.to(q_desc.dtype), p_layout)

    last = (n_tiles - 1) % STAGES
    acc_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))

    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    gl.store(LSE + (b * T + offs_m).to(gl.int64) * H + h, lse, mask=offs_m < T)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [BLOCK_M, D], o_desc.layout)
    o_smem.store(o.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b * T + t_first, h * D], o_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _produce(k_desc, v_desc, k_smem, v_smem, kv_bar, ld, pr_item, pr_tile, pr_n, pr_row, pr_col, n_items, n_m, T,
             window, H: gl.constexpr, G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr):
    """Issue load number ld (tile pr_tile of item pr_item) into slot ld % STAGES, then step the producer to the
    next tile, into the program's next item when this one is done (its first tiles load while the current item
    still computes: that is what the persistent form is for)."""
    slot = ld % STAGES
    _load_kv(k_desc, v_desc, k_smem.index(slot), v_smem.index(slot), kv_bar.index(slot),
             pr_row + pr_tile * BLOCK_N, pr_col, pr_item < n_items)
    pr_tile += 1
    if pr_tile >= pr_n:
        pr_item += gl.num_programs(0)
        b, h, g, t_first, lo, mid_lo, mid_hi, n_tiles = _item_range(pr_item, n_m, T, window, H, G, BLOCK_M,
                                                                    BLOCK_N)
        pr_tile = 0
        pr_n = n_tiles
        pr_row = b * T + lo
        pr_col = g * k_desc.block_type.shape[1]
    return ld + 1, pr_item, pr_tile, pr_n, pr_row, pr_col


@gluon.jit
def window_fwd_persistent_kernel(q_desc, k_desc, v_desc, o_desc, LSE, T, qk_scale, window, n_items, n_m,
                                 H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """window_fwd_kernel's schedule (with OVERLAP), but each program walks items pid, pid + P, ... (P programs,
    a few per multiprocessor): the K/V ring runs on across items and the next item's q tile is fetched while
    the current one computes, so a short range (9 tiles at w = 512) no longer pays its loads' latency alone."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [BLOCK_M, D], o_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    fence_async_shared()

    first = gl.program_id(0)
    step = gl.num_programs(0)
    # the producer starts on this program's first item; STAGES loads ahead of the consumer
    b, h, g, t_first, lo, mid_lo, mid_hi, n_tiles = _item_range(first, n_m, T, window, H, G, BLOCK_M, BLOCK_N)
    ld = 0
    pr_item = first
    pr_tile = 0
    pr_n = n_tiles
    pr_row = b * T + lo
    pr_col = g * D
    for i in gl.static_range(STAGES):
        ld, pr_item, pr_tile, pr_n, pr_row, pr_col = _produce(
            k_desc, v_desc, k_smem, v_smem, kv_bar, ld, pr_item, pr_tile, pr_n, pr_row, pr_col, n_items, n_m, T,
            window, H, G, BLOCK_M, BLOCK_N, STAGES)
    mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * T + t_first, h * D], q_bar.index(0), q_smem.index(0))

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    it = 0  # K/V tiles consumed by this program
    c = 0  # items done by this program
    for item in range(first, n_items, step):
        b, h, g, t_first, lo, mid_lo, mid_hi, n_tiles = _item_range(item, n_m, T, window, H, G, BLOCK_M, BLOCK_N)
        # the next item's q tile into the other buffer (its last reader, item c - 1, is done)
        nq = item + step
        nb, nh, ng, nt_first, nlo, nmid_lo, nmid_hi, nn = _item_range(nq, n_m, T, window, H, G, BLOCK_M, BLOCK_N)
        qn = (c + 1) % 2
        mbarrier.expect(q_bar.index(qn), q_desc.block_type.nbytes, pred=nq < n_items)
        tma.async_copy_global_to_shared(q_desc, [nb * T + nt_first, nh * D], q_bar.index(qn), q_smem.index(qn),
                                        pred=nq < n_items)
        q_cur = q_smem.index(c % 2)
        mbarrier.wait(q_bar.index(c % 2), (c // 2) & 1)

        offs_m = t_first + gl.arange(0, BLOCK_M, layout=rows_s)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)

        slot = it % STAGES
        mbarrier.wait(kv_bar.index(slot), (it // STAGES) & 1)
        s_tok = warpgroup_mma(q_cur, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        offs_n = lo + gl.arange(0, BLOCK_N, layout=cols_s)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, window, True, 0)
        p_prev = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        it += 1
        for j in range(1, n_tiles):
            slot = it % STAGES
            prev = (it - 1) % STAGES
            mbarrier.wait(kv_bar.index(slot), (it // STAGES) & 1)
            s_tok = warpgroup_mma(q_cur, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
            start_n = lo + j * BLOCK_N
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=cols_s)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, window, start_n, mid_lo,
                                               mid_hi, 0)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
            ld, pr_item, pr_tile, pr_n, pr_row, pr_col = _produce(
                k_desc, v_desc, k_smem, v_smem, kv_bar, ld, pr_item, pr_tile, pr_n, pr_row, pr_col, n_items, n_m,
                T, window, H, G, BLOCK_M, BLOCK_N, STAGES)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
            p_prev = gl.convert_layout(p.to(q_desc.dtype), p_layout)
            it += 1
        acc_tok = warpgroup_mma(p_prev, v_smem.index((it - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        ld, pr_item, pr_tile, pr_n, pr_row, pr_col = _produce(
            k_desc, v_desc, k_smem, v_smem, kv_bar, ld, pr_item, pr_tile, pr_n, pr_row, pr_col, n_items, n_m, T,
            window, H, G, BLOCK_M, BLOCK_N, STAGES)

        has_key = l_i > 0
        l_safe = gl.where(has_key, l_i, 1.0)
        lse = gl.where(has_key, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        gl.store(LSE + (b * T + offs_m).to(gl.int64) * H + h, lse, mask=offs_m < T)
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
        tma.store_wait(pendings=0)  # the previous item's o has left o_smem
        o_smem.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b * T + t_first, h * D], o_smem)
        c += 1
    tma.store_wait(pendings=0)
    for i in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))


def _desc(x2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), block, layout)


def window_fwd(q, k, v, window: int, scale: float, block_m: int = 64, block_n: int = 64, stages: int = 2,
               num_warps: int = 4, overlap: bool = True, exp: int = 0):
    """(o, lse) of the window branch: q [B, T, H, D], k and v [B, T, G, D], bf16, contiguous."""
    B, T, H, D = q.shape
    G = k.shape[2]
    if T % block_m or T % block_n:
        raise ValueError(f"the spike needs T ({T}) a multiple of the tiles ({block_m}, {block_n})")
    o = torch.empty_like(q)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    window_fwd_kernel[(T // block_m, B * H)](
        _desc(q.view(B * T, H * D), [block_m, D]), _desc(k.view(B * T, G * D), [block_n, D]),
        _desc(v.view(B * T, G * D), [block_n, D]), _desc(o.view(B * T, H * D), [block_m, D]), lse, T,
        scale * LOG2E, window, H=H, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        OVERLAP=overlap, EXP=exp, num_warps=num_warps)
    return o, lse


PERSISTENT = [  # (block_m, block_n, stages, num_warps, programs per multiprocessor)
    (64, 64, 2, 4, 2), (64, 64, 2, 4, 3), (64, 64, 2, 4, 4), (64, 64, 3, 4, 2), (64, 64, 3, 4, 3),
]
EXP_NAMES = ("mufu", "none (probe)", "poly")
def window_fwd_persistent(q, k, v, window: int, scale: float, block_m: int = 64, block_n: int = 64,
                          stages: int = 2, num_warps: int = 4, programs_per_sm: int = 3):
    """window_fwd through the persistent kernel: programs_per_sm programs on each multiprocessor."""
    B, T, H, D = q.shape
    G = k.shape[2]
    if T % block_m or T % block_n:
        raise ValueError(f"the spike needs T ({T}) a multiple of the tiles ({block_m}, {block_n})")
    o = torch.empty_like(q)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    n_m = T // block_m
    n_items = n_m * B * H
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    window_fwd_persistent_kernel[(min(n_items, sms * programs_per_sm), )](
        _desc(q.view(B * T, H * D), [block_m, D]), _desc(k.view(B * T, G * D), [block_n, D]),
        _desc(v.view(B * T, G * D), [block_n, D]), _desc(o.view(B * T, H * D), [block_m, D]), lse, T,
        scale * LOG2E, window, n_items, n_m, H=H, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        num_warps=num_warps)
    return o, lse


SHAPES = {  # name: (B, T, H, G, D), the window w = 512 of both configurations
    "125m_4x8k": (4, 8192, 12, 2, 64),
    "paper_1x8k": (1, 8192, 64, 4, 128),
    "125m_1x32k": (1, 32768, 12, 2, 64),
}
VARIANTS = [  # (block_m, block_n, stages, num_warps, overlap, exp)
    (64, 64, 2, 4, True, 0), (64, 64, 2, 4, False, 0), (64, 64, 3, 4, True, 0), (128, 64, 2, 8, True, 0),
    (128, 64, 3, 8, True, 0), (64, 64, 2, 4, True, 1), (64, 64, 2, 4, True, 2), (64, 64, 3, 4, True, 1),
]


def _tl_window(q, k, v, window, scale):
    from nsa_model.ops import triton_impl as ti
    return ti._range_fwd(q, k, v, *ti._win_range(window, q.shape[1]), scale)


def _dense_cudnn_fwd(B, T, H, D) -> dict:
    """The FLOP rate of dense causal cuDNN attention's forward at the same shape: the bar for a forward kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     warmup=20, rep=200)
    return dict(cudnn_fwd_ms=ms, cudnn_fwd_tflops=4 * B * H * D * (T * (T + 1) // 2) / ms / 1e9)


def _variant_name(e: dict) -> str:
    name = f"{e['block_m']}x{e['block_n']}, {e['stages']} stages, {e['num_warps']} warps"
    if e.get("persistent"):
        return f"persistent ({e['persistent']} per SM), {name}"
    return f"{name}, {'overlap' if e['overlap'] else 'tl order'}, exp {e['exp']}"


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl kernel, then each Gluon variant as time, FLOP rate, ratio to tl and errors against tl."""
    lines = [f"# Window forward, Gluon spike against the tl kernel: {meta['device']}, {meta['date'][:16]} UTC", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, window w = {meta['window']}, "
             "bf16, median of triton.testing.do_bench. vs tl > 1: the Gluon kernel is faster. Errors: max abs "
             "difference from the tl kernel's o and lse (the probe computes no exponential: its values are "
             "meaningless).", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl `range_attn_fwd_kernel`: {r['tl_ms']:.3f} ms, {r['tl_tflops']:.0f} TFLOP/s; dense causal "
                  f"cuDNN forward at this shape: {r['cudnn_fwd_tflops']:.0f} TFLOP/s", "",
                  "| Gluon variant | ms | TFLOP/s | vs tl | o err | lse err |", "|---|---|---|---|---|---|"]
        for e in r["variants"]:
            if "error" in e:
                lines.append(f"| {_variant_name(e)} | {e['error']} | | | | |")
            else:
                lines.append(f"| {_variant_name(e)} | {e['ms']:.3f} | {e['tflops']:.0f} | {e['vs_tl']:.3f} | "
                             f"{e['o_err']:.2g} | {e['lse_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


def _measure(entry: dict, run, o_ref, lse_ref, flops: int, t_ref: float) -> None:
    """Errors against the tl kernel's output, then the time; a variant that fails is recorded, not fatal."""
    try:
        o, lse = run()
        torch.cuda.synchronize()
        entry["o_err"] = float((o.float() - o_ref.float()).abs().max())
        entry["lse_err"] = float((lse - lse_ref).abs().max())
        ms = triton.testing.do_bench(run, warmup=50, rep=300)
        entry.update(ms=ms, tflops=flops / ms / 1e9, vs_tl=t_ref / ms)
    except Exception as exc:  # a variant that does not compile or fit is a result of the spike
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="", help="commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--suffix", type=file_suffix, default="", help="suffix of the results file names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, (B, T, H, G, D) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, n, D, device="cuda", generator=gen).to(torch.bfloat16) for n in (H, G, G))
        scale = 1.0 / math.sqrt(D)
        o_ref, lse_ref = _tl_window(q, k, v, args.window, scale)
        triton.testing.do_bench(lambda: _tl_window(q, k, v, args.window, scale), warmup=50, rep=300)  # clocks up
        t_ref = triton.testing.do_bench(lambda: _tl_window(q, k, v, args.window, scale), warmup=50, rep=300)
        flops = 4 * B * H * D * sum(min(t + 1, args.window) for t in range(T))
        row = dict(shape=name, B=B, T=T, H=H, G=G, D=D, tl_ms=t_ref, tl_tflops=flops / t_ref / 1e9, variants=[])
        row.update(_dense_cudnn_fwd(B, T, H, D))
        for bm, bn, st, nw, ov, ex in VARIANTS:
            entry = dict(block_m=bm, block_n=bn, stages=st, num_warps=nw, overlap=ov, exp=EXP_NAMES[ex])
            run = lambda: window_fwd(q, k, v, args.window, scale, bm, bn, st, nw, ov, ex)  # noqa: E731
            _measure(entry, run, o_ref, lse_ref, flops, t_ref)
            row["variants"].append(entry)
            print(name, entry, flush=True)
        for bm, bn, st, nw, per_sm in PERSISTENT:
            entry = dict(block_m=bm, block_n=bn, stages=st, num_warps=nw, overlap=True, exp="mufu",
                         persistent=per_sm)
            run = lambda: window_fwd_persistent(q, k, v, args.window, scale, bm, bn, st, nw, per_sm)  # noqa: E731
            _measure(entry, run, o_ref, lse_ref, flops, t_ref)
            row["variants"].append(entry)
            print(name, entry, flush=True)
        rows.append(row)
    stem, meta = result_stem(args.out, "gluon-window-fwd", args.suffix, args.commit or git_commit())
    meta["window"] = args.window
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows))
    print(report(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
