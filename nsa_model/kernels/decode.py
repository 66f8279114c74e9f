"""NSA's decoding step as four small Triton launches a layer: one new query per (batch, kv group) over a model's
cached buffers, split over many programs as FlashDecoding splits a long context. At nsa-125m, 32k positions, on
an H200: 17 us a layer for the four (v68), against 95 us for the first split form that walked its tiles in series
with [HP, BLOCK_N, D] fp32 products instead of tl.dot, and 1.1 ms for one program a (batch, group) (v67).

The same function as ops/decode.py's PyTorch step (NSA_SPEC.md sections 1-7 at the query's position p), which a
decoding step otherwise runs as about a hundred small kernels a layer. A step's work is tiny (nsa-125m at 32k
positions reads about 2 MB a layer, 0.5 us of HBM bandwidth), so its time is latency: launches, dependent loads,
reductions in series. Hence every program does one or two tiles of BLOCK_N keys, and there are as many programs as
tiles:

  nsa_decode_cmp_kernel     grid (B*G, chunks + window tiles): the compressed branch over CHUNK visible slots
                            (i < Nc(p)) a program, or one tile of the window's last w keys (which needs nothing
                            else, so it runs beside the compressed branch), as online-softmax partials (m, l, acc)
  nsa_decode_importance_kernel  grid (B*G, chunks): each head's lse from the compressed partials (one load of all
                            chunks' rows), then its chunk's p_cmp = exp(s - lse) summed over the heads, folded into
                            block importance by the banded overlap (a token starts in one block and spills into at
                            most the next; PER_BLOCK = l'/d tokens start in each block, a power of two) and written
                            as own[j], spill[j]
  nsa_decode_attend_kernel  grid (B*G, n / PARTS): top-n from importance[j] = own[j] + spill[j - 1] (forced
                            blocks first, non-candidates never), then the program's PARTS chosen blocks' keys up
                            to p, as a partial each. Every program makes the whole top-n (no launch to wait for),
                            so PARTS > 1 makes it fewer times where many rows already fill the GPU
  nsa_decode_combine_kernel grid (B*H,): a head's partials of each branch merged, the gated sum stored

Top-n: importance >= 0, so its float bits order like the values; packed above the bits of (NB_PAD - 1 - j) into
one int64 key per block, n rounds of one max each give "largest importance, lowest index among equals", the
spec's tie rule, with forced blocks as +inf and non-candidates negative. Scores are tl.dot products of the heads
of a group (padded to HP >= 16 rows) with a tile of keys, fp32 accumulated; probabilities are cast to the inputs'
dtype for the values' product, as in the training kernels. fp32 inputs take exact fp32 products (DOT_PRECISION).
The position is read from a tensor, so a CUDA graph of the step serves every position. Buffers: [B, L, G, D] raw
keys/values and [B, S, G, D] compressed slots, each with the last dim contiguous (strides passed); q [B, H, Dk]
and gates [B, H, 3] with their last dim contiguous; partials [B*G, parts, HP] (m, l) and
[B*G, parts, HP, BLOCK_DV] (acc), fp32, in the log2 domain.
"""

import triton
import triton.language as tl


@triton.jit
def _rows(X, b, t, g, sb, st, sg, ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[len(t), BLOCK_D] rows of buffer X at positions t of (b, g), in X's dtype; zeros where not ok."""
    d = tl.arange(0, BLOCK_D)
    ptrs = X + b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * st + g * sg + d[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _query(Q, b, g, sqb, sqh, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr):
    """[HP, BLOCK_DK]: the group's HPG heads of the query, zero rows below."""
    rows = tl.arange(0, HP)
    dk = tl.arange(0, BLOCK_DK)
    ptrs = Q + b.to(tl.int64) * sqb + (g * HPG + rows)[:, None] * sqh + dk[None, :]
    return tl.load(ptrs, mask=(rows < HPG)[:, None] & (dk < DK)[None, :], other=0.0)


@triton.jit
def _scores(q, k, ok, qk_scale, DOT_PRECISION: tl.constexpr):
    """[HP, BLOCK_N] log2-scaled scores of q [HP, D] against k [BLOCK_N, D]; -inf where not ok."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    return tl.where(ok[None, :], s, float("-inf"))


@triton.jit
def _online(acc, m, l, s, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: scores s [HP, BLOCK_N] (log2 domain, -inf where hidden), values v [BLOCK_N, DV]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays zeros
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_span(acc, m, l, q, K, V, b, g, skb, skt, skg, svb, svt, svg, lo, hi, qk_scale,
                 DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax over rows lo .. hi - 1 of K, V (both loaded before the scores: one round trip a tile)."""
    offs = tl.arange(0, BLOCK_N)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + offs
        ok = t < hi
        k = _rows(K, b, t, g, skb, skt, skg, ok, DK, BLOCK_DK)
        v = _rows(V, b, t, g, svb, svt, svg, ok, DV, BLOCK_DV)
        acc, m, l = _online(acc, m, l, _scores(q, k, ok, qk_scale, DOT_PRECISION), v, DOT_PRECISION)
    return acc, m, l


@triton.jit
def _visible_slots(pos, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """Nc(p): compressed slots i with i*d + l - 1 <= p."""
    return tl.where(pos + 1 >= CMP_BLOCK, (pos + 1 - CMP_BLOCK) // CMP_STRIDE + 1, 0)


@triton.jit
def _store_partial(PM, PL, PACC, row, acc, m, l, HP: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Partial `row` (an int64 row index of [rows, HP]) of an online softmax."""
    h = tl.arange(0, HP)
    dv = tl.arange(0, BLOCK_DV)
    tl.store(PM + row * HP + h, m)
    tl.store(PL + row * HP + h, l)
    tl.store(PACC + (row * HP + h)[:, None] * BLOCK_DV + dv[None, :], acc)


@triton.jit
def nsa_decode_cmp_kernel(Q, KC, VC, KW, VW, POS, PM, PL, PACC, WM, WL, WACC, sqb, sqh, scb, sct, scg,
                          svcb, svct, svcg, swkb, swkt, swkg, swvb, swvt, swvg, qk_scale,
                          G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                          CHUNK: tl.constexpr, CHUNKS: tl.constexpr, WIN_TILES: tl.constexpr,
                          CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, WINDOW: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    pid, c = tl.program_id(0), tl.program_id(1)
    b, g = pid // G, pid % G
    pos = tl.load(POS)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    if c < CHUNKS:  # compressed slots c*CHUNK .. that query p sees
        hi = tl.minimum(c * CHUNK + CHUNK, _visible_slots(pos, CMP_BLOCK, CMP_STRIDE))
        acc, m, l = _attend_span(acc, m, l, q, KC, VC, b, g, scb, sct, scg, svcb, svct, svcg, c * CHUNK, hi,
                                 qk_scale, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N, DOT_PRECISION)
        _store_partial(PM, PL, PACC, pid.to(tl.int64) * CHUNKS + c, acc, m, l, HP, BLOCK_DV)
    else:  # one CHUNK-key tile of the window, positions max(p - w + 1, 0) .. p
        lo = tl.maximum(pos - WINDOW + 1, 0) + (c - CHUNKS) * CHUNK
        acc, m, l = _attend_span(acc, m, l, q, KW, VW, b, g, swkb, swkt, swkg, swvb, swvt, swvg, lo,
                                 tl.minimum(lo + CHUNK, pos + 1), qk_scale, DK, DV, BLOCK_DK, BLOCK_DV, BLOCK_N,
                                 DOT_PRECISION)
        _store_partial(WM, WL, WACC, pid.to(tl.int64) * WIN_TILES + c - CHUNKS, acc, m, l, HP, BLOCK_DV)


@triton.jit
def nsa_decode_importance_kernel(Q, KC, POS, PM, PL, IMP, sqb, sqh, scb, sct, scg, qk_scale,
                                 G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr,
                                 BLOCK_DK: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                                 CHUNKS_PAD: tl.constexpr, TOKENS: tl.constexpr, CMP_BLOCK: tl.constexpr,
                                 CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr, NB_PAD: tl.constexpr,
                                 DOT_PRECISION: tl.constexpr):
    pid, c = tl.program_id(0), tl.program_id(1)
    b, g = pid // G, pid % G
    nc = _visible_slots(tl.load(POS), CMP_BLOCK, CMP_STRIDE)
    if c * CHUNK >= nc:
        return
    # each head's log2-domain lse over every chunk's partial, in one load
    h = tl.arange(0, HP)
    r = tl.arange(0, CHUNKS_PAD)
    rows = (pid.to(tl.int64) * CHUNKS + r)[:, None] * HP + h[None, :]
    m_i = tl.load(PM + rows, mask=(r < CHUNKS)[:, None], other=float("-inf"))
    m = tl.max(m_i, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.load(PL + rows, mask=(r < CHUNKS)[:, None], other=0.0) * tl.exp2(m_i - m_safe[None, :]), axis=0)
    row_ok = (h < HPG) & (l > 0)
    lse2 = tl.where(row_ok, m_safe + tl.log2(tl.where(l > 0, l, 1.0)), 0.0)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    PER_BLOCK: tl.constexpr = SEL_BLOCK // CMP_STRIDE
    PER_TOKEN: tl.constexpr = CMP_BLOCK // CMP_STRIDE
    TILE_BLOCKS: tl.constexpr = TOKENS // PER_BLOCK
    start = tl.arange(0, PER_BLOCK)  # where in its block a token starts
    w_own = tl.minimum(PER_BLOCK - start, PER_TOKEN).to(tl.float32)
    w_spill = tl.maximum(start + PER_TOKEN - PER_BLOCK, 0).to(tl.float32)
    imp = IMP + pid.to(tl.int64) * 2 * NB_PAD
    tok = tl.arange(0, TOKENS)
    for t0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, nc), TOKENS):  # CHUNK: whole blocks of tokens
        t = t0 + tok
        ok = t < nc
        s = _scores(q, _rows(KC, b, t, g, scb, sct, scg, ok, DK, BLOCK_DK), ok, qk_scale, DOT_PRECISION)
        p = tl.where(row_ok[:, None] & ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        p3 = tl.reshape(tl.sum(p, axis=0), [TILE_BLOCKS, PER_BLOCK])
        blk = t0 // PER_BLOCK + tl.arange(0, TILE_BLOCKS)
        tl.store(imp + blk, tl.sum(p3 * w_own[None, :], axis=1), mask=blk < NB_PAD)
        tl.store(imp + NB_PAD + blk, tl.sum(p3 * w_spill[None, :], axis=1), mask=blk < NB_PAD)


@triton.jit
def _block_keys(imp, j, ok, touched, num_blocks, pos, SEL_BLOCK: tl.constexpr, N_INIT: tl.constexpr,
                N_LOCAL: tl.constexpr, NB_PAD: tl.constexpr):
    """int64 top-n keys of blocks j (any shape; only where ok): importance own[j] + spill[j - 1] as float bits
    above NB_PAD - 1 - j, forced blocks +inf, non-candidates negative, and the least int64 but one where not ok."""
    importance = tl.load(imp + j, mask=ok & (j < touched), other=0.0)
    importance += tl.load(imp + NB_PAD + j - 1, mask=ok & (j >= 1) & (j - 1 < touched), other=0.0)
    candidate = (j < num_blocks) & (j * SEL_BLOCK <= pos)
    forced = candidate & ((j < N_INIT) | ((j + N_LOCAL) * SEL_BLOCK > pos))
    bits = tl.where(forced, 0x7F800000, tl.where(candidate, importance.to(tl.int32, bitcast=True), -1))
    key = (bits.to(tl.int64) << 32) | (NB_PAD - 1 - j).to(tl.int64)
    return tl.where(ok, key, -(2 ** 63) + 1)


@triton.jit
def _top_n(key, slot, N_SEL: tl.constexpr, NB_PAD: tl.constexpr):
    """[N_PAD] int32 (slot's shape): the blocks of key's N_SEL largest keys (a 1-D int64 tensor of _block_keys),
    largest first, -1 where that key is negative (no candidate left). One max a round: keys are distinct."""
    chosen = tl.full(slot.shape, -1, tl.int32)
    for i in tl.static_range(N_SEL):
        top = tl.max(key, axis=0)
        first = (NB_PAD - 1 - (top - ((top >> 32) << 32))).to(tl.int32)  # from the low 32 bits
        chosen = tl.where(slot == i, tl.where(top >= 0, first, -1), chosen)
        key = tl.where(key == top, -(2 ** 63) + 1, key)
    return chosen


@triton.jit
def nsa_decode_attend_kernel(Q, KS, VS, POS, IMP, BLOCKS, PM, PL, PACC,
                             sqb, sqh, skb, skt, skg, svb, svt, svg, num_blocks, qk_scale,
                             G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr,
                             DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_TILE: tl.constexpr,
                             CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
                             N_SEL: tl.constexpr, N_PAD: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                             NB_PAD: tl.constexpr, SEGMENT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                             PARTS: tl.constexpr = 1):
    pid, first_part = tl.program_id(0), tl.program_id(1) * PARTS
    b, g = pid // G, pid % G
    pos = tl.load(POS)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    # top-n in every program (no second launch to wait for)
    touched = tl.cdiv(_visible_slots(pos, CMP_BLOCK, CMP_STRIDE), SEL_BLOCK // CMP_STRIDE)
    imp = IMP + pid.to(tl.int64) * 2 * NB_PAD
    j = tl.arange(0, NB_PAD)
    key = _block_keys(imp, j, j >= 0, touched, num_blocks, pos, SEL_BLOCK, N_INIT, N_LOCAL, NB_PAD)
    slot = tl.arange(0, N_PAD)
    if SEGMENT == 1:  # n rounds over every block
        chosen = _top_n(key, slot, N_SEL, NB_PAD)
    else:
        # Two levels, the same blocks: the n largest keys lie in the segments (SEGMENT blocks each) of the n
        # largest segment maxima (a key outside them has n larger maxima above it), so n rounds over the
        # NB_PAD / SEGMENT maxima, then n rounds over those segments' keys, in place of n rounds over every block.
        top_segments = _top_n(tl.max(tl.reshape(key, [NB_PAD // SEGMENT, SEGMENT]), axis=1), slot, N_SEL, NB_PAD)
        seg = tl.where(top_segments >= 0, top_segments // SEGMENT, -1)
        jj = seg[:, None] * SEGMENT + tl.arange(0, SEGMENT)[None, :]
        keys = _block_keys(imp, jj, (seg >= 0)[:, None] & (jj >= 0), touched, num_blocks, pos, SEL_BLOCK, N_INIT,
                           N_LOCAL, NB_PAD)
        chosen = _top_n(tl.reshape(keys, [N_PAD * SEGMENT]), slot, N_SEL, NB_PAD)
    if first_part == 0:  # the step's blocks, ascending, -1 padded
        ascending = tl.sort(tl.where(chosen < 0, NB_PAD, chosen), dim=0)
        tl.store(BLOCKS + pid.to(tl.int64) * N_SEL + slot, tl.where(ascending == NB_PAD, -1, ascending),
                 mask=slot < N_SEL)
    for i in tl.static_range(PARTS):  # this program's PARTS chosen blocks (the last program's may run out)
        part = first_part + i
        if part < N_SEL:  # a partial each
            block = tl.sum(tl.where(slot == part, chosen, 0), axis=0)
            acc = tl.zeros([HP, BLOCK_DV], tl.float32)
            m = tl.full([HP], float("-inf"), tl.float32)
            l = tl.zeros([HP], tl.float32)
            if block >= 0:  # its keys up to p
                lo = block * SEL_BLOCK
                acc, m, l = _attend_span(acc, m, l, q, KS, VS, b, g, skb, skt, skg, svb, svt, svg, lo,
                                         tl.minimum(lo + SEL_BLOCK, pos + 1), qk_scale, DK, DV, BLOCK_DK, BLOCK_DV,
                                         SEL_TILE, DOT_PRECISION)
            _store_partial(PM, PL, PACC, pid.to(tl.int64) * N_SEL + part, acc, m, l, HP, BLOCK_DV)


@triton.jit
def _branch(PM, PL, PACC, first, count, h, HP: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_ROWS: tl.constexpr):
    """[BLOCK_DV]: head h's output of one branch, its `count` partials from row `first` (int64) merged MERGE_ROWS
    a load (independent loads, not a round trip each); 0 where nothing was visible."""
    r = tl.arange(0, MERGE_ROWS)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    for r0 in range(0, count, MERGE_ROWS):
        ok = r0 + r < count
        rows = (first + r0 + r) * HP + h  # [MERGE_ROWS]
        m_i = tl.load(PM + rows, mask=ok, other=float("-inf"))
        acc_i = tl.load(PACC + rows[:, None] * BLOCK_DV + dv[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_i, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_i - m_safe)
        acc = acc * alpha + tl.sum(acc_i * beta[:, None], axis=0)
        l = l * alpha + tl.sum(tl.load(PL + rows, mask=ok, other=0.0) * beta, axis=0)
        m = m_new
    return acc / tl.where(l > 0, l, 1.0)


@triton.jit
def nsa_decode_combine_kernel(CM, CL, CACC, SM, SL, SACC, WM, WL, WACC, GATES, O, sgb, sgh,
                              G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DV: tl.constexpr, CHUNKS: tl.constexpr, N_SEL: tl.constexpr,
                              WIN_TILES: tl.constexpr, MERGE_ROWS: tl.constexpr):
    pid = tl.program_id(0)  # one head of one batch row
    bg, h = pid // HPG, pid % HPG
    b, g = bg // G, bg % G
    bg = bg.to(tl.int64)
    gate = GATES + b.to(tl.int64) * sgb + (g * HPG + h) * sgh
    o = tl.load(gate).to(tl.float32) * _branch(CM, CL, CACC, bg * CHUNKS, CHUNKS, h, HP, BLOCK_DV, MERGE_ROWS)
    o += tl.load(gate + 1).to(tl.float32) * _branch(SM, SL, SACC, bg * N_SEL, N_SEL, h, HP, BLOCK_DV, MERGE_ROWS)
    o += tl.load(gate + 2).to(tl.float32) * _branch(WM, WL, WACC, bg * WIN_TILES, WIN_TILES, h, HP, BLOCK_DV,
                                                    MERGE_ROWS)
    dv = tl.arange(0, BLOCK_DV)
    tl.store(O + (bg * HPG + h) * DV + dv, o.to(O.dtype.element_ty), mask=dv < DV)
