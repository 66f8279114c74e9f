"""Attention of each query over a contiguous range of keys: NSA's compressed and window branches.

Key j stands at position j * key_stride + key_offset and query t sees it iff

    0 <= t - (j * key_stride + key_offset) < window

  compressed branch: key_stride = d, key_offset = l - 1 (compressed token j ends there), window = T (no lower bound)
  window branch:     key_stride = 1, key_offset = 0, window = w

Only queries t < num_queries (<= T) are computed: T is the sequence length, the pitch of the query rows.

Layouts: q [B, T, H, DK], o [B, T, H, DV], lse/delta [B, T, H] fp32, contiguous; k [B, NK, G, DK] and v [B, NK, G, DV]
with each token's G x D values contiguous and tokens K_ROW / V_ROW elements apart (G * D when contiguous; more
for one key set sliced out of the model's stacked projection, which the kernels read in place).
Head h reads kv head h // (H // G). FlashAttention-2 style: forward keeps an online softmax in registers; backward
runs one kernel for dQ (per query tile and head) and one for dK/dV (per key tile and a slice of the group's
heads; see range_attn_bwd_dkdv_kernel). Row offsets are computed in int64 (B*T*H*D can exceed 2^31).

TWO_RANGES (constexpr, dQ): one program also covers a second range of keys for the same query tile (its own K/V,
key_stride, key_offset, window, lse and delta) and stores the sum of both ranges' dQ. nsa::core runs its
compressed and window branches' dQ that way (ops/triton_impl.py, range_pair): each query tile and its do are
loaded once for both, and one dQ is stored instead of two. The forward stays one range per launch: two ranges in
one program ran slower on the H100 (kernels-notes.md, v17). dK/dV stays per range.

TMA (constexpr): the q, do, k and v tiles come in through tensor descriptors (QD, DOD, KD, VD: 2-D row views,
block = one tile) instead of pointer loads: Hopper's tensor memory accelerator copies a tile into shared memory
without spending a register per element on addresses and masks (v23: the forward took 107 registers instead of
168 and ran 12-20% faster). A descriptor zero-fills rows past the end of the whole tensor only; rows past a
sequence's end belong to the next sequence and are finite, so every mask below that reads row or key bounds
masks scores or stores, never relies on zero-filled inputs. Without TMA those arguments are unused.

HEADS (constexpr, forward and dQ): a tile's BLOCK_M rows are BLOCK_M // HEADS consecutive queries times HEADS
heads of one group (row r: query t_first + r // HEADS, head h0 + r % HEADS) instead of BLOCK_M queries of one head.
Every head of a group sees the same keys with the same mask, so a key tile read from L2 serves HEADS heads' rows
at once (HEADS times fewer key and value bytes a query), and the tile's causal edge spans HEADS times fewer
positions. HEADS = 1 is one head a tile (the layout before v60). With TMA the packed tile comes in through a 3-D
descriptor over [B * T, H, D] (block [BLOCK_M // HEADS, HEADS, D]), reshaped to rows.

EDGE_SPLIT (constexpr): each program walks its tiles in three runs, masked / full / masked, where a full tile is
one every (query, key) pair of which is visible and in bounds, so it skips the visibility mask, the bounds masks
and the guard for rows with nothing visible. Only the tiles at the causal edge and the window's far edge need
them: in the window branch at w = 512 with 64 x 64 tiles that is 2 of 9 tiles. EDGE_SPLIT = False masks every
tile (the v4 kernels, kept selectable for the benchmark).
"""

import triton
import triton.language as tl


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N: tl.constexpr,
               EDGE_SPLIT: tl.constexpr):
    """(lo, mid_lo, mid_hi, hi): queries t_first..t_last may see keys [lo, hi) (lo rounded down to a tile);
    the tiles of [mid_lo, mid_hi) are seen whole by every one of them."""
    hi = (t_last - key_offset + key_stride) // key_stride
    hi = tl.minimum(tl.maximum(hi, 0), num_keys)
    x = t_first - window - key_offset
    lo = tl.where(x >= 0, x // key_stride + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    if EDGE_SPLIT:
        # full keys: position <= t_first (causal for the first query), t_last - position < window (the last one)
        c = t_first - key_offset
        full_hi = tl.minimum(tl.where(c >= 0, c // key_stride + 1, 0), hi)
        y = t_last - key_offset - window
        full_lo = tl.where(y >= 0, y // key_stride + 1, 0)
        mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
        mid_hi = mid_lo + (tl.maximum(full_hi - mid_lo, 0) // BLOCK_N) * BLOCK_N
    else:
        mid_lo = hi
        mid_hi = hi
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _load_rows(ptrs, row_ok, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """A [rows, BLOCK_D] tile; rows masked by row_ok only where MASK_ROWS (a full tile's rows are all in bounds),
    columns only where the head dim is padded."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    elif BLOCK_D == D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def _key_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, start_n, n_ok, num_keys, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK_ROWS: tl.constexpr,
              TMA: tl.constexpr):
    """The k and v tiles of keys start_n .. start_n + BLOCK_N of (b, g); with TMA unmasked (see the header)."""
    if TMA:
        k = KD.load([b * num_keys + start_n, g * DK])
        v = VD.load([b * num_keys + start_n, g * DV])
    else:
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        tok = (b * num_keys + start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = _load_rows(K + tok[:, None] * K_ROW + g * DK + offs_dk[None, :], n_ok, offs_dk, DK, BLOCK_DK, MASK_ROWS)
        v = _load_rows(V + tok[:, None] * V_ROW + g * DV + offs_dv[None, :], n_ok, offs_dv, DV, BLOCK_DV, MASK_ROWS)
    return k, v


@triton.jit
def _query_tile(Q, QD, row_q, m_ok, b, h, T, t_first, D: tl.constexpr, BLOCK_D: tl.constexpr,
                MASK_ROWS: tl.constexpr, TMA: tl.constexpr, HEADS: tl.constexpr = 1, BLOCK_M: tl.constexpr = 0):
    """The [BLOCK_M, BLOCK_D] tile of q (or do) of queries t_first.. of (b, h); with TMA unmasked. HEADS > 1: rows
    packed as the header says, h the tile's first head (QD then a 3-D descriptor)."""
    if TMA and HEADS > 1:
        x = tl.reshape(QD.load([b * T + t_first, h, 0]), [BLOCK_M, D])
    elif TMA:
        x = QD.load([b * T + t_first, h * D])
    else:
        offs_d = tl.arange(0, BLOCK_D)
        x = _load_rows(Q + row_q[:, None] * D + offs_d[None, :], m_ok, offs_d, D, BLOCK_D, MASK_ROWS)
    return x


@triton.jit
def _query_rows(pid_m, pid_bh, num_queries, H: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                HEADS: tl.constexpr):
    """(b, g, h0, offs_m, h, t_first, t_last) of a forward or dQ program: its batch, group and first head, each
    row's query and head, and the first and last query it holds (rows as the header's HEADS says)."""
    QUERIES: tl.constexpr = BLOCK_M // HEADS
    b = pid_bh // (H // HEADS)
    h0 = (pid_bh % (H // HEADS)) * HEADS
    g = h0 // (H // G)
    rows = tl.arange(0, BLOCK_M)
    t_first = pid_m * QUERIES
    offs_m = t_first + rows // HEADS
    h = h0 + rows % HEADS
    t_last = tl.minimum(t_first + QUERIES, num_queries) - 1
    return b, g, h0, offs_m, h, t_first, t_last


@triton.jit
def _query_tile_index():
    """The query tile of a forward, dQ or selection program: the grid's first axis reversed. The GPU dispatches
    that axis first, and in the compressed branch and the selection a later tile sees
    more keys, so its programs start longest first and the last wave holds the shortest (longest-first
    scheduling; the selection at 125m 1 x 32k 0.739 -> 0.586 ms, v25). The window branch's tiles are all alike."""
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def _visible(offs_m, offs_n, key_stride, key_offset, window):
    rel = offs_m[:, None] - (offs_n[None, :] * key_stride + key_offset)
    return (rel >= 0) & (rel < window)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, start, stop, hi, num_keys, qk_scale,
               key_stride, key_offset, window, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k, v = _key_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, start_n, n_ok, num_keys, DK, DV, BLOCK_DK, BLOCK_DV,
                         BLOCK_N, MASKED, TMA)
        # the raw scores' maximum, scaled once a row: the scale then goes into the exponential's argument, one FMA
        # an element instead of a multiply and a subtraction (a positive scale; kernels-notes.md v42, v43)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay zeros
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # every row sees every key: finite
            m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def range_attn_fwd_kernel(Q, K, V, QD, KD, VD, O, LSE, T, num_queries, num_keys, scale, key_stride, key_offset,
                          window, K_ROW, V_ROW,
                          H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, EDGE_SPLIT: tl.constexpr, TMA: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1):
    b, g, h0, offs_m, h, t_first, t_last = _query_rows(_query_tile_index(), tl.program_id(1), num_queries, H, G,
                                                       BLOCK_M, HEADS)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < num_queries
    row_q = (b * T + offs_m).to(tl.int64) * H + h
    q = _query_tile(Q, QD, row_q, m_ok, b, h0, T, t_first, DK, BLOCK_DK, True, TMA, HEADS, BLOCK_M)
    lo, mid_lo, mid_hi, hi = _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N,
                                        EDGE_SPLIT)
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, lo, mid_lo, hi, num_keys,
                               qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                               True, TMA, DOT_PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, mid_lo, mid_hi, hi, num_keys,
                               qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                               False, TMA, DOT_PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, mid_hi, hi, hi, num_keys,
                               qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                               True, TMA, DOT_PRECISION)

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    tl.store(O + row_q[:, None] * DV + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + row_q, lse, mask=m_ok)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, start, stop, hi, num_keys,
              qk_scale, key_stride, key_offset, window, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_n in range(start, stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k, v = _key_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, start_n, n_ok, num_keys, DK, DV, BLOCK_DK, BLOCK_DV,
                         BLOCK_N, MASKED, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :]
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_range(dq, q, do, LSE, DELTA, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, m_ok, row_q, t_first, t_last,
              num_keys, qk_scale, key_stride, key_offset, window, G: tl.constexpr, DK: tl.constexpr,
              DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              EDGE_SPLIT: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dq plus the (unscaled) dQ of the loaded query tile over one range of keys, with that range's lse and delta."""
    # Rows with no visible key have lse = -inf; 0 instead keeps exp2(s - lse) finite (they are masked or padding).
    lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + row_q, mask=m_ok, other=0.0)
    lo, mid_lo, mid_hi, hi = _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N,
                                        EDGE_SPLIT)
    dq = _dq_tiles(dq, q, do, lse2, delta, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, lo, mid_lo, hi, num_keys,
                   qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, True, TMA,
                   DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, mid_lo, mid_hi, hi, num_keys,
                   qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, False, TMA,
                   DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, mid_hi, hi, hi, num_keys,
                   qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, True, TMA,
                   DOT_PRECISION)
    return dq


@triton.jit
def range_attn_bwd_dq_kernel(Q, K, V, DO, QD, KD, VD, DOD, K2D, V2D, LSE, DELTA, DQ, T, num_queries, num_keys,
                             scale, key_stride, key_offset, window, K_ROW, V_ROW, K2, V2, LSE2, DELTA2, num_keys2,
                             key_stride2, key_offset2, window2, K2_ROW, V2_ROW,
                             H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, EDGE_SPLIT: tl.constexpr, ACCUMULATE: tl.constexpr,
                             TWO_RANGES: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             DQ_SLOTS=None, SLOT_BLOCKS=None, N_SLOTS: tl.constexpr = 0, HEADS: tl.constexpr = 1):
    """ACCUMULATE: add this dQ to what DQ holds (the selected branch's dQ, where the range dQ runs after it).
    TWO_RANGES: dQ is the sum over two ranges (the second with its own keys, lse and delta; the same do): the
    compressed and window branches' dQ from one load of each query tile and one store.
    N_SLOTS > 0: also add the selected branch's dQ contributions, one per slot of each query's N_SLOTS
    (selected_by_block.py's DQ_MODE 1 rows; slots whose block in SLOT_BLOCKS [B, T, G, N_SLOTS] is -1 hold
    nothing): its slot sum, done here where the loads overlap other programs' matrix work instead of in a pass
    of its own (kernels-notes.md v29)."""
    b, g, h0, offs_m, h, t_first, t_last = _query_rows(_query_tile_index(), tl.program_id(1), num_queries, H, G,
                                                       BLOCK_M, HEADS)
    offs_dk = tl.arange(0, BLOCK_DK)
    m_ok = offs_m < num_queries
    row_q = (b * T + offs_m).to(tl.int64) * H + h
    q = _query_tile(Q, QD, row_q, m_ok, b, h0, T, t_first, DK, BLOCK_DK, True, TMA, HEADS, BLOCK_M)
    do = _query_tile(DO, DOD, row_q, m_ok, b, h0, T, t_first, DV, BLOCK_DV, True, TMA, HEADS, BLOCK_M)
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    dq = _dq_range(dq, q, do, LSE, DELTA, K, V, KD, VD, K_ROW, V_ROW, b, g, offs_m, m_ok, row_q, t_first, t_last,
                   num_keys, qk_scale, key_stride, key_offset, window, G, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                   EDGE_SPLIT, TMA, DOT_PRECISION)
    if TWO_RANGES:
        dq = _dq_range(dq, q, do, LSE2, DELTA2, K2, V2, K2D, V2D, K2_ROW, V2_ROW, b, g, offs_m, m_ok, row_q,
                       t_first, t_last, num_keys2, qk_scale, key_stride2, key_offset2, window2, G, DK, DV, BLOCK_DK,
                       BLOCK_DV, BLOCK_N, EDGE_SPLIT, TMA, DOT_PRECISION)
    dq = dq * scale
    dq_ptrs = DQ + row_q[:, None] * DK + offs_dk[None, :]
    dq_ok = m_ok[:, None] & (offs_dk < DK)[None, :]
    if N_SLOTS > 0:
        slot0 = ((b * T + offs_m).to(tl.int64) * G + g) * N_SLOTS
        for i in range(N_SLOTS):
            used = m_ok & (tl.load(SLOT_BLOCKS + slot0 + i, mask=m_ok, other=-1) >= 0)
            row_p = (slot0 + i) * (H // G) + h % (H // G)
            dq += tl.load(DQ_SLOTS + row_p[:, None] * DK + offs_dk[None, :], mask=used[:, None] & dq_ok,
                          other=0.0, eviction_policy="evict_first").to(tl.float32)  # read once (v43)
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=dq_ok, other=0.0).to(tl.float32)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, h, offs_n, n_ok, start_m, T, num_queries, qk_scale,
               key_stride, key_offset, window, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dk, dv plus the key tile's share from the query tile start_m.. of head h."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < num_queries
    row_q = (b * T + offs_m).to(tl.int64) * H + h
    q = _query_tile(Q, QD, row_q, m_ok, b, h, T, start_m, DK, BLOCK_DK, MASKED, TMA)
    do = _query_tile(DO, DOD, row_q, m_ok, b, h, T, start_m, DV, BLOCK_DV, MASKED, TMA)
    if MASKED:
        lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
        delta = tl.load(DELTA + row_q, mask=m_ok, other=0.0)
    else:  # a full query tile lies inside [0, num_queries)
        lse2 = tl.load(LSE + row_q) * LOG2E
        delta = tl.load(DELTA + row_q)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
        vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :] & m_ok[:, None]
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse2[:, None])  # every query of a full tile sees a key: its lse is finite
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, first_head, offs_n, n_ok, start, stop, T, num_queries,
                qk_scale, key_stride, key_offset, window, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1):
    """The query tiles start.. stop of heads first_head .. first_head + HEADS - 1, in one loop: each tile's heads
    one after the other (LOOP_HEADS in range_attn_bwd_dkdv_kernel)."""
    if HEADS == 1:
        for start_m in range(start, stop, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, first_head, offs_n, n_ok, start_m, T,
                                num_queries, qk_scale, key_stride, key_offset, window, H, DK, DV, BLOCK_DK,
                                BLOCK_DV, BLOCK_M, MASKED, TMA, DOT_PRECISION)
    else:
        for i in range(0, tl.cdiv(tl.maximum(stop - start, 0), BLOCK_M) * HEADS):
            dk, dv = _dkdv_step(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, first_head + i % HEADS, offs_n, n_ok,
                                start + (i // HEADS) * BLOCK_M, T, num_queries, qk_scale, key_stride, key_offset,
                                window, H, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_M, MASKED, TMA, DOT_PRECISION)
    return dk, dv


@triton.jit
def range_attn_bwd_dkdv_kernel(Q, K, V, DO, QD, KD, VD, DOD, LSE, DELTA, DK_ACC, DV_ACC, T, num_queries, num_keys,
                               scale, key_stride, key_offset, window, q_chunk, K_ROW, V_ROW, H: tl.constexpr,
                               G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               HEAD_SPLIT: tl.constexpr, EDGE_SPLIT: tl.constexpr, ATOMIC: tl.constexpr,
                               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGNED_CHUNKS: tl.constexpr = False,
                               LOOP_HEADS: tl.constexpr = 1):
    """One program per (slice of HPG / HEAD_SPLIT heads of a group, key tile, chunk of q_chunk of the queries
    that see the tile). HEAD_SPLIT = 1 and one chunk: the program loops over the whole group and stores (exact,
    deterministic; right for the window branch, whose tiles see few queries). Otherwise (ATOMIC) the programs of
    a key tile meet by float32 atomic adds: one head per program and the query axis in chunks keep the
    compressed branch's tiles, the first of which is seen by every query, spread over the whole GPU.

    The head slices are the grid's first axis, which the GPU dispatches fastest, and key tiles the second: every
    program of tile 0 starts before any of tile 1. In the compressed branch the
    early tiles see the most queries, so the longest programs start first and the last wave holds the shortest
    ones (longest-first scheduling). Tiles first, the long programs of the last head slices ran on alone at the
    end: 32.8 ms at paper 1 x 64k against 26.3 now (v25).

    ALIGNED_CHUNKS (ATOMIC): the chunks are absolute, queries [c q_chunk, (c + 1) q_chunk) for c = program_id(2),
    not counted from each tile's first query, and the grid is (key tiles, head slices, chunks). The programs that
    run together are then the key tiles of one head slice over one chunk: they read the same q and dO rows, a
    working set of q_chunk rows that stays in L2, where the relative chunks' tiles of 64 heads each stream their own
    rows (v51: 32% L2 hits, DRAM at 70% of its peak at paper 64k; v57). A key tile after its chunk returns before
    loading its keys.

    LOOP_HEADS (a program over several heads: the window's, one a group): each run of the edge split is one loop
    over (query tile, head) pairs for LOOP_HEADS heads at a time, a tile's heads in turn, instead of the three runs
    once per head (3 x heads short loops, each filling and draining its pipeline). More heads a loop also means
    more query rows read between two neighbouring key tiles' reads of the same rows, so the launcher picks
    LOOP_HEADS, a divisor of the program's heads, by head dim (LaunchConfig.range_dkdv_loop_heads, with the
    measurements)."""
    HPG: tl.constexpr = H // G
    HEADS: tl.constexpr = HPG // HEAD_SPLIT
    if ALIGNED_CHUNKS:
        pid_bgs = tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_bgs = tl.program_id(0)
        pid_n = tl.program_id(1)
    b = pid_bgs // (G * HEAD_SPLIT)
    g = (pid_bgs // HEAD_SPLIT) % G
    first_head = g * HPG + (pid_bgs % HEAD_SPLIT) * HEADS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < num_keys
    tok = (b * num_keys + offs_n).to(tl.int64)
    row_k = tok * G + g  # the gradients' rows: dK and dV are contiguous
    # Queries that may see this tile: from its first key's position to its last key's position + window - 1.
    first_pos = pid_n * BLOCK_N * key_stride + key_offset
    last_pos = (pid_n * BLOCK_N + BLOCK_N - 1) * key_stride + key_offset
    t_lo = (first_pos // BLOCK_M) * BLOCK_M
    t_hi = tl.minimum(num_queries, last_pos + window)
    # this program's chunk of them (q_chunk is a multiple of BLOCK_M, so tiles stay aligned)
    if ALIGNED_CHUNKS:
        c_lo = tl.program_id(2) * q_chunk
        t_lo = tl.maximum(t_lo, c_lo)
        t_hi = tl.minimum(t_hi, c_lo + q_chunk)
        if t_hi <= t_lo:  # a key tile after its chunk (about half the grid): no loads, nothing to add
            return
    else:
        t_lo = t_lo + tl.program_id(2) * q_chunk
        t_hi = tl.minimum(t_hi, t_lo + q_chunk)
    k, v = _key_tile(K, V, KD, VD, K_ROW, V_ROW, b, g, pid_n * BLOCK_N, n_ok, num_keys, DK, DV, BLOCK_DK, BLOCK_DV,
                     BLOCK_N, True, TMA)
    if EDGE_SPLIT:
        # Full query tiles: every query at or after the last key, before the first key's window end, inside T;
        # and every key of the tile in bounds.
        full_lo = tl.minimum(t_lo + tl.cdiv(tl.maximum(last_pos - t_lo, 0), BLOCK_M) * BLOCK_M, t_hi)
        full_lo = tl.maximum(full_lo, t_lo)  # an empty chunk (t_hi < t_lo) runs no loop
        full_end = tl.minimum(t_hi, first_pos + window)
        keys_full = (pid_n + 1) * BLOCK_N <= num_keys
        full_hi = tl.where(keys_full, full_lo + (tl.maximum(full_end - full_lo, 0) // BLOCK_M) * BLOCK_M, full_lo)
    else:
        full_lo = t_hi
        full_hi = t_hi
    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # LOOP_HEADS heads in each tile loop; the program's heads in HEADS / LOOP_HEADS passes of its three loops
    tl.static_assert(HEADS % LOOP_HEADS == 0, "LOOP_HEADS must divide the program's heads")
    for head in range(0, HEADS, LOOP_HEADS):
        h = first_head + head
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, h, offs_n, n_ok, t_lo, full_lo, T,
                             num_queries, qk_scale, key_stride, key_offset, window, H, DK, DV, BLOCK_DK, BLOCK_DV,
                             BLOCK_M, True, TMA, DOT_PRECISION, LOOP_HEADS)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, h, offs_n, n_ok, full_lo, full_hi, T,
                             num_queries, qk_scale, key_stride, key_offset, window, H, DK, DV, BLOCK_DK, BLOCK_DV,
                             BLOCK_M, False, TMA, DOT_PRECISION, LOOP_HEADS)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, b, h, offs_n, n_ok, full_hi, t_hi, T,
                             num_queries, qk_scale, key_stride, key_offset, window, H, DK, DV, BLOCK_DK, BLOCK_DV,
                             BLOCK_M, True, TMA, DOT_PRECISION, LOOP_HEADS)
    dk = dk * scale
    dk_ptrs = DK_ACC + row_k[:, None] * DK + offs_dk[None, :]
    dv_ptrs = DV_ACC + row_k[:, None] * DV + offs_dv[None, :]
    if not ATOMIC:
        tl.store(dk_ptrs, dk, mask=n_ok[:, None] & (offs_dk < DK)[None, :])
        tl.store(dv_ptrs, dv, mask=n_ok[:, None] & (offs_dv < DV)[None, :])
    elif t_lo < t_hi:  # empty chunks add nothing
        # relaxed: only later kernels read the sums; tl.atomic_add's default (acq_rel) fences every add (v51)
        tl.atomic_add(dk_ptrs, dk, mask=n_ok[:, None] & (offs_dk < DK)[None, :], sem="relaxed")
        tl.atomic_add(dv_ptrs, dv, mask=n_ok[:, None] & (offs_dv < DV)[None, :], sem="relaxed")
