"""Selected-block attention (NSA_SPEC.md section 5), group-centric, forward and backward.

Forward and dQ: one program per (query t, batch, kv group) loads the query rows of all the group's heads at once
(HEADS_PAD >= 16 rows so the matrix units are used) and walks the group's n selected blocks, so each selected
block's keys and values are read once for the whole group (paper section 3.4).

dK/dV: an inverted index (block -> the queries that chose it, built by one stable sort outside) lets one program
own one key block and loop over its choosers, ENTRIES queries x HEADS_PAD heads per step. A block chosen by many
queries (the forced first block is chosen by all) is split into CHUNK-sized pieces over the grid's third axis,
whose partial sums meet by atomic adds into float32 buffers (a block with one piece gets a single add onto zeros,
which is exact).

Layouts: q [B, T, H, DK], blocks [B, T, G, N_SELECT] int32 (-1 = none), o [B, T, H, DV], lse/delta [B, T, H] fp32,
contiguous; k [B, T, G, DK] and v [B, T, G, DV] with tokens K_ROW / V_ROW elements apart (range_attention.py).
"""

import triton
import triton.language as tl

from nsa_model.kernels.gates import gate_rows
from nsa_model.kernels.selected_by_block import _block_kv
from nsa_model.kernels.selected_tiled import _block_tile

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def selected_attn_fwd_kernel(Q, K, V, KD, VD, BLOCKS, O, LSE, T, scale, K_ROW, V_ROW,
                             H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                             BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, HEADS_PAD: tl.constexpr,
                             TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, GATES=None, O_CMP=None, O_WIN=None,
                             O_GATED=None, GATED: tl.constexpr = False):
    """GATED (nsa::core): also the gated output O_GATED = g_cmp O_CMP + g_slc O + g_win O_WIN from the stored values
    of the three (gates.py's gate_rows), so no gate pass follows."""
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    HPG: tl.constexpr = H // G
    offs_h = tl.arange(0, HEADS_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < HPG
    row_q = (b * T + t).to(tl.int64) * H + g * HPG + offs_h
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=h_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    block_row = ((b * T + t).to(tl.int64) * G + g) * N_SELECT

    qk_scale = scale * LOG2E
    m_i = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, BLOCK_DV], tl.float32)
    for i in range(N_SELECT):
        # No branch on the block id (-1: fewer than n blocks exist) so the loop stays software-pipelined.
        blk = tl.load(BLOCKS + block_row + i)
        first = blk * SEL_BLOCK
        s_ok = (offs_s < tl.minimum(SEL_BLOCK, t - first + 1)) & (blk >= 0)  # in the block, at or before t
        # with TMA unmasked: keys past t, past the block or of block -1 are masked out of the scores
        k, v = _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, first + offs_s, s_ok, T, DK, DV, BLOCK_DK, BLOCK_DV,
                           SEL_BLOCK, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(s_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block after t (not a valid choice) adds 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    at = row_q[:, None] * DV + offs_dv[None, :]
    ok = h_ok[:, None] & (offs_dv < DV)[None, :]
    tl.store(O + at, o, mask=ok)
    tl.store(LSE + row_q, lse, mask=h_ok)
    if GATED:  # o_cmp and o_win are read here for the last time in the forward
        o_cmp = tl.load(O_CMP + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o_win = tl.load(O_WIN + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        gated = gate_rows(GATES, row_q, h_ok, o_cmp, o.to(tl.float32), o_win)
        tl.store(O_GATED + at, gated.to(O_GATED.dtype.element_ty), mask=ok)


@triton.jit
def selected_attn_bwd_dq_kernel(Q, K, V, KD, VD, BLOCKS, DO, LSE, DELTA, DQ, T, scale, K_ROW, V_ROW,
                                H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                                BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, HEADS_PAD: tl.constexpr,
                                TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """ACCUMULATE: add this dQ to what DQ holds (the other branches' dQ), in float32 before the store."""
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    HPG: tl.constexpr = H // G
    offs_h = tl.arange(0, HEADS_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < HPG
    row_q = (b * T + t).to(tl.int64) * H + g * HPG + offs_h
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=h_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=h_ok[:, None] & (offs_dv < DV)[None, :],
                 other=0.0)
    lse2 = tl.load(LSE + row_q, mask=h_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_q, mask=h_ok, other=0.0)
    block_row = ((b * T + t).to(tl.int64) * G + g) * N_SELECT

    dq_ptrs = DQ + row_q[:, None] * DK + offs_dk[None, :]
    dq_ok = h_ok[:, None] & (offs_dk < DK)[None, :]
    if ACCUMULATE:  # loaded before the loop, where its latency hides (as in the tiled dQ kernel, v25)
        dq_in = tl.load(dq_ptrs, mask=dq_ok, other=0.0)
    qk_scale = scale * LOG2E
    dq = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)
    for i in range(N_SELECT):
        blk = tl.load(BLOCKS + block_row + i)
        first = blk * SEL_BLOCK
        s_ok = (offs_s < tl.minimum(SEL_BLOCK, t - first + 1)) & (blk >= 0)
        # with TMA unmasked: keys past t, past the block or of block -1 are masked out of the scores
        k, v = _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, first + offs_s, s_ok, T, DK, DV, BLOCK_DK, BLOCK_DV,
                           SEL_BLOCK, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.where(s_ok[None, :] & h_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq = dq * scale
    if ACCUMULATE:
        dq += dq_in.to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)


@triton.jit
def selected_attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, QUERY_OF_ENTRY, STARTS, DK_ACC, DV_ACC,
                                  T, num_blocks, scale, K_ROW, V_ROW,
                                  H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                  BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                                  BLOCK_S: tl.constexpr, HEADS_PAD: tl.constexpr, ENTRIES: tl.constexpr,
                                  CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_j = tl.program_id(0)
    pid_bg = tl.program_id(1)
    pid_c = tl.program_id(2)
    b = pid_bg // G
    g = pid_bg % G
    HPG: tl.constexpr = H // G
    ROWS: tl.constexpr = ENTRIES * HEADS_PAD
    segment = pid_bg * num_blocks + pid_j
    seg_end = tl.load(STARTS + segment + 1)
    start = tl.load(STARTS + segment) + pid_c * CHUNK
    end = tl.minimum(seg_end, start + CHUNK)
    if start < end:
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        k, v, pos, s_ok, row_k = _block_kv(K, V, K, V, K_ROW, V_ROW, b, g, pid_j, T, G, DK, DV, BLOCK_DK, BLOCK_DV,
                                           SEL_BLOCK, BLOCK_S, False, True)  # int64 offsets, as always here
        # Row r of a step is (entry r // HEADS_PAD, head r % HEADS_PAD).
        offs_r = tl.arange(0, ROWS)
        slot = offs_r // HEADS_PAD
        head = offs_r % HEADS_PAD
        qk_scale = scale * LOG2E
        dk = tl.zeros([BLOCK_S, BLOCK_DK], tl.float32)
        dv = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
        for e0 in range(start, end, ENTRIES):
            entry = e0 + slot
            r_ok = (entry < end) & (head < HPG)
            t = tl.load(QUERY_OF_ENTRY + entry, mask=r_ok, other=0)
            row_q = (b * T + t).to(tl.int64) * H + g * HPG + head
            q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=r_ok[:, None] & (offs_dk < DK)[None, :],
                        other=0.0)
            do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=r_ok[:, None] & (offs_dv < DV)[None, :],
                         other=0.0)
            lse2 = tl.load(LSE + row_q, mask=r_ok, other=0.0) * LOG2E
            delta = tl.load(DELTA + row_q, mask=r_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            vis = r_ok[:, None] & s_ok[None, :] & (pos[None, :] <= t[:, None])
            p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
        dk = dk * scale
        tl.atomic_add(DK_ACC + row_k[:, None] * DK + offs_dk[None, :], dk,
                      mask=s_ok[:, None] & (offs_dk < DK)[None, :], sem="relaxed")  # read by later kernels only
        tl.atomic_add(DV_ACC + row_k[:, None] * DV + offs_dv[None, :], dv,
                      mask=s_ok[:, None] & (offs_dv < DV)[None, :], sem="relaxed")


@triton.jit
def selected_dq_from_ds_kernel(K, KD, BLOCKS, DS, DQ, T, K_ROW, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                               BLOCK_DK: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                               N_SELECT: tl.constexpr, HEADS_PAD: tl.constexpr, TMA: tl.constexpr,
                               DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """One query's dQ from the ds that by_block's backward stored at its slots (DQ_MODE 3): the sum over its n
    slots of ds [heads, BLOCK_S] times the slot's keys. One product and one key tile a slot where the kernel above
    runs three products on key and value tiles; no q, do, lse or delta. A slot of block -1 loads no ds (zeros).
    DS rows: (((b * T + t) * G + g) * N_SELECT + slot) * HPG + head, BLOCK_S wide. ACCUMULATE as above."""
    t = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    HPG: tl.constexpr = H // G
    offs_h = tl.arange(0, HEADS_PAD)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dk = tl.arange(0, BLOCK_DK)
    h_ok = offs_h < HPG
    row_q = (b * T + t).to(tl.int64) * H + g * HPG + offs_h
    block_row = ((b * T + t).to(tl.int64) * G + g) * N_SELECT

    dq_ptrs = DQ + row_q[:, None] * DK + offs_dk[None, :]
    dq_ok = h_ok[:, None] & (offs_dk < DK)[None, :]
    if ACCUMULATE:
        dq_in = tl.load(dq_ptrs, mask=dq_ok, other=0.0)
    dq = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)
    for i in range(N_SELECT):
        # No branch on the block id, as in the kernels above: the loop stays software-pipelined.
        blk = tl.load(BLOCKS + block_row + i)
        ds = tl.load(DS + ((block_row + i) * HPG + offs_h)[:, None] * BLOCK_S + offs_s[None, :],
                     mask=(h_ok & (blk >= 0))[:, None], other=0.0)
        if TMA:
            k = KD.load([b * T + blk * SEL_BLOCK, g * DK])
        else:
            pos = blk * SEL_BLOCK + offs_s
            s_ok = (offs_s < SEL_BLOCK) & (pos < T) & (blk >= 0)
            k = tl.load(K + (b * T + pos).to(tl.int64)[:, None] * K_ROW + g * DK + offs_dk[None, :],
                        mask=s_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
        dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    if ACCUMULATE:
        dq += dq_in.to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)
