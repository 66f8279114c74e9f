"""Selected-block attention over query tiles (NSA_SPEC.md section 5): forward and dQ.

The per-query kernels (selected_attention.py) reload every selected block once per query, so at small groups
their time goes to L2 traffic, not to the matrix units. Here one program owns TILE_Q = ROWS // HPG consecutive
queries of one (batch, kv group); its ROWS matrix rows are (query, head) pairs packed without padding, row r =
query r // HPG, head r % HPG, so 64 rows hold 10 queries of a 6-head group (60 useful rows; padding each query
to 8 heads held 8 queries, 48 useful rows). The last ROWS - TILE_Q * HPG rows are masked: they would belong to
the next tile's first query, whose blocks this tile's union need not hold.
It walks the sorted union of the tile's selected blocks (built outside by tile_block_union in triton_impl.py),
loading each block's keys and values once for the whole tile; a per-row membership (is this block among the row's
query's choices? bit q of the union entry's mask, built with the union: a shift a row where comparing the row's
n choices with the block cost about 35 instructions a step, v52) and the causal mask decide which rows see it.
Neighbouring queries of trained models choose mostly the same blocks, so the union stays near n; random inputs
make it up to TILE_Q * n long.

Full and edge blocks (v52): the union is ascending, so its first entries are the blocks that end before the
tile's first query; every query of the tile sees all their keys. Those run in a loop of their own without the
per-element causal mask: a row whose query did not choose the block gets -inf through one per-row term of the
exponential's FMA (the forward's running maximum and exponent, the dQ's log-sum-exp), not a select on each of
its scores. The few blocks that reach into the tile (its queries' local blocks) keep the element mask.

TMA (constexpr): each block's keys and values come in through tensor descriptors (KD, VD; range_attention.py
says why), unmasked: rows past the block or the sequence are masked out of the scores (vis). The query tile
packs (query, head) rows, not one strided run, so it stays a pointer load (once per program).

dK/dV keep the inverted-index kernel of selected_attention.py (it already loads each key block once).

Layouts (contiguous unless said): q [B, T, H, DK], k [B, T, G, DK] and v [B, T, G, DV] with tokens K_ROW / V_ROW
elements apart (range_attention.py), union [B, num_tiles, G, TILE_Q * N_SELECT] int32 (ascending, padding after
`count` entries), count [B, num_tiles, G] int32, members (as union) int64 (bit q: the tile's query q chose it),
o [B, T, H, DV], lse/delta [B, T, H] fp32.
"""

import triton
import triton.language as tl

from nsa_model.kernels.gates import gate_rows


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_rows(T, H, G, HPG: tl.constexpr, ROWS: tl.constexpr, TILE_Q: tl.constexpr):
    """(query t, valid, row offset into [B*T*H]) of each (query, head) row of this program's tile. Index
    arithmetic in int32 with constexpr divisors (multiply-shifts); only the row offset is 64-bit."""
    pid_tile = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    offs_r = tl.arange(0, ROWS)
    t = pid_tile * TILE_Q + offs_r // HPG
    head = offs_r % HPG
    r_ok = (t < T) & (offs_r < TILE_Q * HPG)
    row_q = (b * T + t).to(tl.int64) * H + g * HPG + head
    return b, g, t, r_ok, row_q


@triton.jit
def _member(MEMBERS, tile_row, i, r_ok, HPG: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS] whether each row's query chose union entry i: bit (row // HPG) of the entry's mask."""
    bits = tl.load(MEMBERS + tile_row * WIDTH + i)
    q_in_tile = tl.minimum(tl.arange(0, ROWS) // HPG, 63).to(tl.int64)  # rows past the tile: r_ok is false
    return (((bits >> q_in_tile) & 1) != 0) & r_ok


@triton.jit
def _full_blocks(UNION, tile_row, count, t_first, SEL_BLOCK: tl.constexpr, WIDTH: tl.constexpr,
                 WIDTH_PAD: tl.constexpr):
    """How many of the tile's union entries (ascending) end at or before its first query t_first: the blocks
    every query of the tile sees whole."""
    offs = tl.arange(0, WIDTH_PAD)
    ids = tl.load(UNION + tile_row * WIDTH + offs, mask=offs < count, other=0)
    full = (offs < count) & (ids < (t_first + 1) // SEL_BLOCK)
    return tl.sum(full.to(tl.int32), axis=0)


@triton.jit
def _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, pos, s_ok, T, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, TMA: tl.constexpr):
    """The keys and values of selection block blk of (b, g): [BLOCK_S, D] tiles, unmasked with TMA."""
    if TMA:
        k = KD.load([b * T + blk * SEL_BLOCK, g * DK])
        v = VD.load([b * T + blk * SEL_BLOCK, g * DV])
    else:
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        tok = (b * T + pos).to(tl.int64)
        k = tl.load(K + tok[:, None] * K_ROW + g * DK + offs_dk[None, :], mask=s_ok[:, None] & (offs_dk < DK)[None, :],
                    other=0.0)
        v = tl.load(V + tok[:, None] * V_ROW + g * DV + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0)
    return k, v


@triton.jit
def _union_entry(K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, r_ok, tile_row, i, T, HPG: tl.constexpr,
                 ROWS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                 BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, WIDTH: tl.constexpr,
                 TMA: tl.constexpr):
    """What a forward or dQ step reads of the tile's union entry i: (member, pos, s_ok, k, v), the rows whose
    query chose the block, its key positions, which of them exist, and its key and value tiles."""
    offs_s = tl.arange(0, BLOCK_S)
    blk = tl.load(UNION + tile_row * WIDTH + i)
    member = _member(MEMBERS, tile_row, i, r_ok, HPG, ROWS, WIDTH)
    pos = blk * SEL_BLOCK + offs_s
    s_ok = (offs_s < SEL_BLOCK) & (pos < T)
    k, v = _block_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, blk, pos, s_ok, T, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK,
                       TMA)
    return member, pos, s_ok, k, v


@triton.jit
def _backward_rows(Q, DO, LSE, DELTA, row_q, r_ok, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """(q, do, lse in log2 units, delta) of the rows row_q of [B*T*H] (zeros where not r_ok): what a backward
    step reads per query row."""
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=r_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=r_ok[:, None] & (offs_dv < DV)[None, :],
                 other=0.0)
    lse2 = tl.load(LSE + row_q, mask=r_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_q, mask=r_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _fwd_step(acc, m_i, l_i, q, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok, tile_row, i, T,
              qk_scale, HPG: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
              SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, WIDTH: tl.constexpr, TMA: tl.constexpr,
              DOT_PRECISION: tl.constexpr, EDGE: tl.constexpr):
    """Union entry i against the tile's rows: online softmax. EDGE: the block may reach past a row's query or
    past T (the element mask); otherwise every row sees the whole block or, not having chosen it, none of it
    (and only a block size short of the tile's power of two masks columns)."""
    member, pos, s_ok, k, v = _union_entry(K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, r_ok, tile_row, i, T,
                                           HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, WIDTH, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # scaled in the exponential's FMA (range_attention)
    if EDGE:
        s = tl.where(member[:, None] & s_ok[None, :] & (pos[None, :] <= t[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet adds 0
        p = tl.exp2(s * qk_scale - m_safe[:, None])
    else:  # -inf for a row that did not choose the block, in its maximum and its exponent's offset
        if BLOCK_S != SEL_BLOCK:  # the tile's last columns are the next block's keys
            s = tl.where(s_ok[None, :], s, float("-inf"))
        bias = tl.where(member, 0.0, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale + bias)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * qk_scale - (m_safe - bias)[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _dq_step(dq, q, do, lse2, delta, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok, tile_row, i, T,
             qk_scale, HPG: tl.constexpr, ROWS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
             SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, WIDTH: tl.constexpr, TMA: tl.constexpr,
             DOT_PRECISION: tl.constexpr, EDGE: tl.constexpr):
    """Union entry i's part of the tile's dQ; EDGE as in _fwd_step (without it, a row that did not choose the
    block gets an infinite log-sum-exp, so p = 0)."""
    member, pos, s_ok, k, v = _union_entry(K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, r_ok, tile_row, i, T,
                                           HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, WIDTH, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if EDGE:
        vis = member[:, None] & s_ok[None, :] & (pos[None, :] <= t[:, None])
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(s - tl.where(member, lse2, float("inf"))[:, None])
        if BLOCK_S != SEL_BLOCK:  # the tile's last columns are the next block's keys
            p = tl.where(s_ok[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def selected_tiled_fwd_kernel(Q, K, V, KD, VD, UNION, COUNT, MEMBERS, O, LSE, T, num_tiles, scale, K_ROW, V_ROW,
                              H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                              BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr,
                              ROWS: tl.constexpr, TILE_Q: tl.constexpr, WIDTH_PAD: tl.constexpr,
                              TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, GATES=None, O_CMP=None, O_WIN=None,
                              O_GATED=None, GATED: tl.constexpr = False):
    """GATED (nsa::core): also the gated output O_GATED = g_cmp O_CMP + g_slc O + g_win O_WIN from the stored
    values of the three (gates.py's gate_rows, as by_block's combine does), so no gate pass follows."""
    HPG: tl.constexpr = H // G
    b, g, t, r_ok, row_q = _tile_rows(T, H, G, HPG, ROWS, TILE_Q)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=r_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    tile_row = (b * num_tiles + tl.program_id(0)).to(tl.int64) * G + g
    count = tl.load(COUNT + tile_row)

    qk_scale = scale * LOG2E
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    WIDTH: tl.constexpr = TILE_Q * N_SELECT
    n_full = _full_blocks(UNION, tile_row, count, tl.program_id(0) * TILE_Q, SEL_BLOCK, WIDTH, WIDTH_PAD)
    for i in range(0, n_full):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok,
                                  tile_row, i, T, qk_scale, HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK,
                                  BLOCK_S, WIDTH, TMA, DOT_PRECISION, False)
    for i in range(n_full, count):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok,
                                  tile_row, i, T, qk_scale, HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK,
                                  BLOCK_S, WIDTH, TMA, DOT_PRECISION, True)

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = (acc / l_safe[:, None]).to(O.dtype.element_ty)
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    at = row_q[:, None] * DV + offs_dv[None, :]
    ok = r_ok[:, None] & (offs_dv < DV)[None, :]
    tl.store(O + at, o, mask=ok)
    tl.store(LSE + row_q, lse, mask=r_ok)
    if GATED:  # o_cmp and o_win are read here for the last time in the forward
        o_cmp = tl.load(O_CMP + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o_win = tl.load(O_WIN + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        gated = gate_rows(GATES, row_q, r_ok, o_cmp, o.to(tl.float32), o_win)
        tl.store(O_GATED + at, gated.to(O_GATED.dtype.element_ty), mask=ok)


@triton.jit
def selected_tiled_bwd_dq_kernel(Q, K, V, KD, VD, UNION, COUNT, MEMBERS, DO, LSE, DELTA, DQ, T, num_tiles, scale, K_ROW,
                                 V_ROW,
                                 H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                                 BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                                 BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr,
                                 ROWS: tl.constexpr, TILE_Q: tl.constexpr, WIDTH_PAD: tl.constexpr,
                                 TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """ACCUMULATE: DQ holds the other branches' dQ, and this branch's is added to it in float32 before the one
    store (no add pass after, which read and wrote a q-sized tensor more)."""
    HPG: tl.constexpr = H // G
    b, g, t, r_ok, row_q = _tile_rows(T, H, G, HPG, ROWS, TILE_Q)
    offs_dk = tl.arange(0, BLOCK_DK)
    q, do, lse2, delta = _backward_rows(Q, DO, LSE, DELTA, row_q, r_ok, DK, DV, BLOCK_DK, BLOCK_DV)
    tile_row = (b * num_tiles + tl.program_id(0)).to(tl.int64) * G + g
    count = tl.load(COUNT + tile_row)

    dq_ptrs = DQ + row_q[:, None] * DK + offs_dk[None, :]
    dq_ok = r_ok[:, None] & (offs_dk < DK)[None, :]
    if ACCUMULATE:  # loaded before the loop: at its end the load's latency showed (+0.16 ms at paper 8k, v25)
        dq_in = tl.load(dq_ptrs, mask=dq_ok, other=0.0)
    qk_scale = scale * LOG2E
    dq = tl.zeros([ROWS, BLOCK_DK], tl.float32)
    WIDTH: tl.constexpr = TILE_Q * N_SELECT
    n_full = _full_blocks(UNION, tile_row, count, tl.program_id(0) * TILE_Q, SEL_BLOCK, WIDTH, WIDTH_PAD)
    for i in range(0, n_full):
        dq = _dq_step(dq, q, do, lse2, delta, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok, tile_row,
                      i, T, qk_scale, HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, WIDTH, TMA,
                      DOT_PRECISION, False)
    for i in range(n_full, count):
        dq = _dq_step(dq, q, do, lse2, delta, K, V, KD, VD, UNION, MEMBERS, K_ROW, V_ROW, b, g, t, r_ok, tile_row,
                      i, T, qk_scale, HPG, ROWS, DK, DV, BLOCK_DK, BLOCK_DV, SEL_BLOCK, BLOCK_S, WIDTH, TMA,
                      DOT_PRECISION, True)
    dq = dq * scale
    if ACCUMULATE:
        dq += dq_in.to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)


@triton.jit
def selected_tiled_dq_from_ds_kernel(K, KD, UNION, COUNT, MEMBERS, BLOCKS, DS, DQ, T, num_tiles, K_ROW,
                                     H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr,
                                     SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr,
                                     N_PAD: tl.constexpr, ROWS: tl.constexpr, TILE_Q: tl.constexpr,
                                     TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """The tile's dQ from the ds that by_block's backward stored (DQ_MODE 3): for each union entry, its member
    rows' ds [ROWS, BLOCK_S] times the block's keys. One product a block where the kernel above runs three (s, dp,
    dq), and no q, do, v, lse or delta reads; a row that did not choose the block loads nothing (zeros), and ds is
    already zero past the row's query, so there is no mask on the scores. The ds row of (query, block) is at the
    query's slot of that block: each row keeps its query's n choices in registers and finds the slot by comparing
    them with the entry's block. DS rows: ((b * T + t) * G + g) * N_SELECT + slot) * HPG + head, BLOCK_S wide.
    ACCUMULATE as in selected_tiled_bwd_dq_kernel."""
    HPG: tl.constexpr = H // G
    WIDTH: tl.constexpr = TILE_Q * N_SELECT
    b, g, t, r_ok, row_q = _tile_rows(T, H, G, HPG, ROWS, TILE_Q)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_s = tl.arange(0, BLOCK_S)
    offs_n = tl.arange(0, N_PAD)
    head = tl.arange(0, ROWS) % HPG
    tile_row = (b * num_tiles + tl.program_id(0)).to(tl.int64) * G + g
    count = tl.load(COUNT + tile_row)
    slot0 = ((b * T + t).to(tl.int64) * G + g) * N_SELECT  # [ROWS] the row's query's first slot
    choices = tl.load(BLOCKS + slot0[:, None] + offs_n[None, :], mask=r_ok[:, None] & (offs_n < N_SELECT)[None, :],
                      other=-1)

    dq_ptrs = DQ + row_q[:, None] * DK + offs_dk[None, :]
    dq_ok = r_ok[:, None] & (offs_dk < DK)[None, :]
    if ACCUMULATE:
        dq_in = tl.load(dq_ptrs, mask=dq_ok, other=0.0)
    dq = tl.zeros([ROWS, BLOCK_DK], tl.float32)
    for i in range(0, count):
        blk = tl.load(UNION + tile_row * WIDTH + i)
        member = _member(MEMBERS, tile_row, i, r_ok, HPG, ROWS, WIDTH)
        slot = tl.sum(tl.where(choices == blk, offs_n[None, :], 0), axis=1)
        ds_row = (slot0 + slot) * HPG + head
        ds = tl.load(DS + ds_row[:, None] * BLOCK_S + offs_s[None, :], mask=member[:, None], other=0.0)
        if TMA:
            k = KD.load([b * T + blk * SEL_BLOCK, g * DK])
        else:
            pos = blk * SEL_BLOCK + offs_s
            s_ok = (offs_s < SEL_BLOCK) & (pos < T)
            tok = (b * T + pos).to(tl.int64)
            k = tl.load(K + tok[:, None] * K_ROW + g * DK + offs_dk[None, :],
                        mask=s_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
        dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    if ACCUMULATE:
        dq += dq_in.to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)
