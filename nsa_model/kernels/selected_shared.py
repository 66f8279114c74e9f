"""Selected-block attention, forward and dQ: per-query matrix work, block loads shared by a tile of queries.

The per-query kernels (selected_attention.py) give each query's group of heads its own program (HEADS_PAD rows)
and load each of its n blocks from L2 for that query alone: at the paper shape (16 heads x head dim 128) they run
at L2's bandwidth, 32 KB of keys and values per (query, block). The tiled kernels (selected_tiled.py) load each
block of a tile's union once, but run every row of the tile against it: on near-random selections most union
blocks were chosen by one of the tile's queries, so most of that matrix work is masked away (a union of 2.2 n at
paper 8k: 2.2 times the needed work).

Here one program owns QUERIES consecutive queries of one (batch, kv group), each with its own HEADS_PAD-row
state (q, do, the online softmax or the dQ accumulator), and walks the sorted union of their blocks (built outside
by tile_block_union, as for tiled) loading each block once. A query runs its matrix products on a block only if
it chose it (a branch on a scalar), so the matrix work is exactly the per-query kernels', and the loads are the
union's: at paper 8k, 2.2 n blocks for 4 queries instead of 4 n.

QUERIES is 1, 2 or 4; the state of each query is written out (q0 .. q3) because a tile's queries are separate
matrix operands, not rows of one. Masks: a block chosen by a query lies at or before the query's own block, so
only keys past t (its own block) or past T are masked.

Layouts as in selected_tiled.py: q [B, T, H, DK], k [B, T, G, DK] and v [B, T, G, DV] (tokens K_ROW / V_ROW apart),
blocks [B, T, G, N_SELECT] int32 (-1 = none), union [B, num_tiles, G, QUERIES * N_SELECT] int32 (ascending, padding
after `count` entries), count [B, num_tiles, G] int32, o [B, T, H, DV], lse/delta [B, T, H] fp32.
"""

import triton
import triton.language as tl

from nsa_model.kernels.selected_tiled import _block_tile

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _query_rows(b, g, t, T, H: tl.constexpr, HPG: tl.constexpr, HEADS_PAD: tl.constexpr):
    """(row offsets into [B*T*H], valid) of query t's heads in group g; none valid past T."""
    offs_h = tl.arange(0, HEADS_PAD)
    row = (b * T + t).to(tl.int64) * H + g * HPG + offs_h
    return row, (offs_h < HPG) & (t < T)


@triton.jit
def _query_choices(BLOCKS, b, g, t, T, G, N_SELECT: tl.constexpr, N_PAD: tl.constexpr):
    """[N_PAD] the blocks query t chose (-1: none, padding, or t past T)."""
    offs_n = tl.arange(0, N_PAD)
    base = ((b * T + t).to(tl.int64) * G + g) * N_SELECT
    return tl.load(BLOCKS + base + offs_n, mask=(offs_n < N_SELECT) & (t < T), other=-1)


@triton.jit
def _load_rows(X, row, ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(X + row[:, None] * D + offs_d[None, :], mask=ok[:, None] & (offs_d < D)[None, :], other=0.0)


@triton.jit
def _visible_keys(blk, t, T, offs_s, SEL_BLOCK: tl.constexpr):
    """[BLOCK_S] keys of block blk that query t sees: in the block, at or before t (so before T)."""
    first = blk * SEL_BLOCK
    return offs_s < tl.minimum(SEL_BLOCK, t - first + 1)


@triton.jit
def _fwd_query(acc, m_i, l_i, q, choices, blk, k, v, t, T, offs_s, qk_scale, SEL_BLOCK: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """One query's online-softmax step over block blk, if the query chose it."""
    if tl.max((choices == blk).to(tl.int32), axis=0) > 0:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(_visible_keys(blk, t, T, offs_s, SEL_BLOCK)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: a chosen block holds a key at or before t
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_store(O, LSE, acc, m_i, l_i, row, ok, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    offs_dv = tl.arange(0, BLOCK_DV)
    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    tl.store(O + row[:, None] * DV + offs_dv[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + row, lse, mask=ok)


@triton.jit
def _tile_start(T, G: tl.constexpr, QUERIES: tl.constexpr, N_SELECT: tl.constexpr, num_tiles):
    """(b, g, first query, the tile's union row offset) of this program."""
    pid_tile = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    tile_row = (b * num_tiles + pid_tile).to(tl.int64) * G + g
    return b, g, pid_tile * QUERIES, tile_row


@triton.jit
def selected_shared_fwd_kernel(Q, K, V, KD, VD, BLOCKS, UNION, COUNT, O, LSE, T, num_tiles, scale, K_ROW, V_ROW,
                               H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                               BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, N_PAD: tl.constexpr,
                               HEADS_PAD: tl.constexpr, QUERIES: tl.constexpr, TMA: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    HPG: tl.constexpr = H // G
    b, g, t0, tile_row = _tile_start(T, G, QUERIES, N_SELECT, num_tiles)
    offs_s = tl.arange(0, BLOCK_S)
    qk_scale = scale * LOG2E
    count = tl.load(COUNT + tile_row)

    row0, ok0 = _query_rows(b, g, t0, T, H, HPG, HEADS_PAD)
    q0 = _load_rows(Q, row0, ok0, DK, BLOCK_DK)
    c0 = _query_choices(BLOCKS, b, g, t0, T, G, N_SELECT, N_PAD)
    acc0 = tl.zeros([HEADS_PAD, BLOCK_DV], tl.float32)
    m0 = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    l0 = tl.zeros([HEADS_PAD], tl.float32)
    if QUERIES > 1:
        row1, ok1 = _query_rows(b, g, t0 + 1, T, H, HPG, HEADS_PAD)
        q1 = _load_rows(Q, row1, ok1, DK, BLOCK_DK)
        c1 = _query_choices(BLOCKS, b, g, t0 + 1, T, G, N_SELECT, N_PAD)
        acc1 = tl.zeros([HEADS_PAD, BLOCK_DV], tl.float32)
        m1 = tl.full([HEADS_PAD], float("-inf"), tl.float32)
        l1 = tl.zeros([HEADS_PAD], tl.float32)
    if QUERIES > 2:
        row2, ok2 = _query_rows(b, g, t0 + 2, T, H, HPG, HEADS_PAD)
        q2 = _load_rows(Q, row2, ok2, DK, BLOCK_DK)
        c2 = _query_choices(BLOCKS, b, g, t0 + 2, T, G, N_SELECT, N_PAD)
        acc2 = tl.zeros([HEADS_PAD, BLOCK_DV], tl.float32)
        m2 = tl.full([HEADS_PAD], float("-inf"), tl.float32)
        l2 = tl.zeros([HEADS_PAD], tl.float32)
        row3, ok3 = _query_rows(b, g, t0 + 3, T, H, HPG, HEADS_PAD)
        q3 = _load_rows(Q, row3, ok3, DK, BLOCK_DK)
        c3 = _query_choices(BLOCKS, b, g, t0 + 3, T, G, N_SELECT, N_PAD)
        acc3 = tl.zeros([HEADS_PAD, BLOCK_DV], tl.float32)
        m3 = tl.full([HEADS_PAD], float("-inf"), tl.float32)
        l3 = tl.zeros([HEADS_PAD], tl.float32)

    for i in range(0, count):
        blk = tl.load(UNION + tile_row * (QUERIES * N_SELECT) + i)
        pos = blk * SEL_BLOCK + offs_s
        k, v = _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, pos, (offs_s < SEL_BLOCK) & (pos < T), T, DK, DV,
                           BLOCK_DK, BLOCK_DV, SEL_BLOCK, TMA)
        acc0, m0, l0 = _fwd_query(acc0, m0, l0, q0, c0, blk, k, v, t0, T, offs_s, qk_scale, SEL_BLOCK, DOT_PRECISION)
        if QUERIES > 1:
            acc1, m1, l1 = _fwd_query(acc1, m1, l1, q1, c1, blk, k, v, t0 + 1, T, offs_s, qk_scale, SEL_BLOCK,
                                      DOT_PRECISION)
        if QUERIES > 2:
            acc2, m2, l2 = _fwd_query(acc2, m2, l2, q2, c2, blk, k, v, t0 + 2, T, offs_s, qk_scale, SEL_BLOCK,
                                      DOT_PRECISION)
            acc3, m3, l3 = _fwd_query(acc3, m3, l3, q3, c3, blk, k, v, t0 + 3, T, offs_s, qk_scale, SEL_BLOCK,
                                      DOT_PRECISION)

    _fwd_store(O, LSE, acc0, m0, l0, row0, ok0, DV, BLOCK_DV)
    if QUERIES > 1:
        _fwd_store(O, LSE, acc1, m1, l1, row1, ok1, DV, BLOCK_DV)
    if QUERIES > 2:
        _fwd_store(O, LSE, acc2, m2, l2, row2, ok2, DV, BLOCK_DV)
        _fwd_store(O, LSE, acc3, m3, l3, row3, ok3, DV, BLOCK_DV)


@triton.jit
def _dq_query(dq, q, do, lse2, delta, choices, blk, k, v, t, T, offs_s, qk_scale, SEL_BLOCK: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """One query's dQ step over block blk (unscaled), if the query chose it."""
    if tl.max((choices == blk).to(tl.int32), axis=0) > 0:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.where(_visible_keys(blk, t, T, offs_s, SEL_BLOCK)[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_rows(DO, LSE, DELTA, DQ, row, ok, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
             BLOCK_DV: tl.constexpr, ACCUMULATE: tl.constexpr):
    """(do, lse in log2 units, delta, the dQ already there) of one query's rows; without ACCUMULATE the last is
    a placeholder the kernel never reads. The dQ is loaded before the loop: at its end the load's latency showed
    in the tiled kernel (+0.16 ms at paper 8k, v25)."""
    do = _load_rows(DO, row, ok, DV, BLOCK_DV)
    lse2 = tl.load(LSE + row, mask=ok, other=0.0) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows that see nothing: masked anyway
    delta = tl.load(DELTA + row, mask=ok, other=0.0)
    if ACCUMULATE:
        dq_in = _load_rows(DQ, row, ok, DK, BLOCK_DK)
    else:
        dq_in = delta
    return do, lse2, delta, dq_in


@triton.jit
def _dq_store(DQ, dq, dq_in, scale, row, ok, DK: tl.constexpr, BLOCK_DK: tl.constexpr, ACCUMULATE: tl.constexpr):
    offs_dk = tl.arange(0, BLOCK_DK)
    dq = dq * scale
    if ACCUMULATE:
        dq += dq_in.to(tl.float32)
    tl.store(DQ + row[:, None] * DK + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=ok[:, None] & (offs_dk < DK)[None, :])


@triton.jit
def selected_shared_bwd_dq_kernel(Q, K, V, KD, VD, BLOCKS, UNION, COUNT, DO, LSE, DELTA, DQ, T, num_tiles, scale,
                                  K_ROW, V_ROW,
                                  H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                  BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                                  BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, N_PAD: tl.constexpr,
                                  HEADS_PAD: tl.constexpr, QUERIES: tl.constexpr, TMA: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """ACCUMULATE: DQ holds the other branches' dQ; this branch's is added to it before the one store."""
    HPG: tl.constexpr = H // G
    b, g, t0, tile_row = _tile_start(T, G, QUERIES, N_SELECT, num_tiles)
    offs_s = tl.arange(0, BLOCK_S)
    qk_scale = scale * LOG2E
    count = tl.load(COUNT + tile_row)

    row0, ok0 = _query_rows(b, g, t0, T, H, HPG, HEADS_PAD)
    q0 = _load_rows(Q, row0, ok0, DK, BLOCK_DK)
    do0, lse0, delta0, dq_in0 = _dq_rows(DO, LSE, DELTA, DQ, row0, ok0, DK, DV, BLOCK_DK, BLOCK_DV, ACCUMULATE)
    c0 = _query_choices(BLOCKS, b, g, t0, T, G, N_SELECT, N_PAD)
    dq0 = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)
    if QUERIES > 1:
        row1, ok1 = _query_rows(b, g, t0 + 1, T, H, HPG, HEADS_PAD)
        q1 = _load_rows(Q, row1, ok1, DK, BLOCK_DK)
        do1, lse1, delta1, dq_in1 = _dq_rows(DO, LSE, DELTA, DQ, row1, ok1, DK, DV, BLOCK_DK, BLOCK_DV, ACCUMULATE)
        c1 = _query_choices(BLOCKS, b, g, t0 + 1, T, G, N_SELECT, N_PAD)
        dq1 = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)
    if QUERIES > 2:
        row2, ok2 = _query_rows(b, g, t0 + 2, T, H, HPG, HEADS_PAD)
        q2 = _load_rows(Q, row2, ok2, DK, BLOCK_DK)
        do2, lse2, delta2, dq_in2 = _dq_rows(DO, LSE, DELTA, DQ, row2, ok2, DK, DV, BLOCK_DK, BLOCK_DV, ACCUMULATE)
        c2 = _query_choices(BLOCKS, b, g, t0 + 2, T, G, N_SELECT, N_PAD)
        dq2 = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)
        row3, ok3 = _query_rows(b, g, t0 + 3, T, H, HPG, HEADS_PAD)
        q3 = _load_rows(Q, row3, ok3, DK, BLOCK_DK)
        do3, lse3, delta3, dq_in3 = _dq_rows(DO, LSE, DELTA, DQ, row3, ok3, DK, DV, BLOCK_DK, BLOCK_DV, ACCUMULATE)
        c3 = _query_choices(BLOCKS, b, g, t0 + 3, T, G, N_SELECT, N_PAD)
        dq3 = tl.zeros([HEADS_PAD, BLOCK_DK], tl.float32)

    for i in range(0, count):
        blk = tl.load(UNION + tile_row * (QUERIES * N_SELECT) + i)
        pos = blk * SEL_BLOCK + offs_s
        k, v = _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, pos, (offs_s < SEL_BLOCK) & (pos < T), T, DK, DV,
                           BLOCK_DK, BLOCK_DV, SEL_BLOCK, TMA)
        dq0 = _dq_query(dq0, q0, do0, lse0, delta0, c0, blk, k, v, t0, T, offs_s, qk_scale, SEL_BLOCK, DOT_PRECISION)
        if QUERIES > 1:
            dq1 = _dq_query(dq1, q1, do1, lse1, delta1, c1, blk, k, v, t0 + 1, T, offs_s, qk_scale, SEL_BLOCK,
                            DOT_PRECISION)
        if QUERIES > 2:
            dq2 = _dq_query(dq2, q2, do2, lse2, delta2, c2, blk, k, v, t0 + 2, T, offs_s, qk_scale, SEL_BLOCK,
                            DOT_PRECISION)
            dq3 = _dq_query(dq3, q3, do3, lse3, delta3, c3, blk, k, v, t0 + 3, T, offs_s, qk_scale, SEL_BLOCK,
                            DOT_PRECISION)

    _dq_store(DQ, dq0, dq_in0, scale, row0, ok0, DK, BLOCK_DK, ACCUMULATE)
    if QUERIES > 1:
        _dq_store(DQ, dq1, dq_in1, scale, row1, ok1, DK, BLOCK_DK, ACCUMULATE)
    if QUERIES > 2:
        _dq_store(DQ, dq2, dq_in2, scale, row2, ok2, DK, BLOCK_DK, ACCUMULATE)
        _dq_store(DQ, dq3, dq_in3, scale, row3, ok3, DK, BLOCK_DK, ACCUMULATE)
