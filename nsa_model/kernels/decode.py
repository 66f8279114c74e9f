"""NSA's decoding step as four small Triton launches a layer: one new query per (batch, kv group) over a model's
cached buffers, split over programs as FlashDecoding splits a long context.

The same function as ops/decode.py's PyTorch step (NSA_SPEC.md sections 1-7 at the query's position p), which a
decoding step otherwise runs as about a hundred small kernels a layer; their launches, not their work, were the
step's time on an H200 (v67: 5.5 ms of GPU time a token at nsa-125m, 12 layers). One program per (batch, group)
walking the whole step in order was slower still (1.1 ms a layer at 32k positions: two programs on the GPU). So:

  nsa_decode_cmp_kernel     grid (B*G, chunks): the compressed branch over CHUNK visible slots (i < Nc(p)) a
                            program, as online-softmax partials (m, l, acc) per head
  nsa_decode_importance_kernel  grid (B*G, chunks): each head's lse from the partials, then its chunk's
                            p_cmp = exp(s - lse) summed over the heads, folded into block importance by the banded
                            overlap (a token starts in one block and spills into at most the next; PER_BLOCK = l'/d
                            tokens start in each block, a power of two) and written as own[j], spill[j]
  nsa_decode_attend_kernel  grid (B*G, n + window tiles): top-n from importance[j] = own[j] + spill[j - 1] (forced
                            blocks +inf, non-candidates -inf; n rounds of "largest key, lowest index among equals",
                            the spec's tie rule), then one chosen block's keys up to p, or one tile of the window's
                            last w keys, as partials
  nsa_decode_combine_kernel grid (B*G,): each branch's partials merged, the gated sum stored

Scores are products summed in fp32 registers ([HP, BLOCK_N, D] at a time, no tl.dot: a decoding step's rows are
few), exponentials exp2 of log2-scaled scores. The position is read from a tensor, so a CUDA graph of the step
serves every position. Buffers: [B, L, G, D] raw keys/values and [B, S, G, D] compressed slots, each with the
last dim contiguous (strides passed); q [B, H, Dk] and gates [B, H, 3] with their last dim contiguous; partials
[B*G, parts, HP] (m, l) and [B*G, parts, HP, BLOCK_DV] (acc), fp32.
"""

import triton
import triton.language as tl


@triton.jit
def _rows(X, b, t, g, sb, st, sg, ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[len(t), BLOCK_D] fp32 rows of buffer X at positions t of (b, g); zeros where not ok."""
    d = tl.arange(0, BLOCK_D)
    ptrs = X + b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * st + g * sg + d[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _query(Q, b, g, sqb, sqh, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr):
    rows = tl.arange(0, HP)
    dk = tl.arange(0, BLOCK_DK)
    ptrs = Q + b.to(tl.int64) * sqb + (g * HPG + rows)[:, None] * sqh + dk[None, :]
    return tl.load(ptrs, mask=(rows < HPG)[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scores(q, k, ok, qk_scale):
    """[HP, BLOCK_N] log2-scaled scores of q [HP, D] against k [BLOCK_N, D]; -inf where not ok."""
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale
    return tl.where(ok[None, :], s, float("-inf"))


@triton.jit
def _online(acc, m, l, s, v):
    """One online-softmax step: scores s [HP, BLOCK_N] (log2 domain, -inf where hidden), values v [BLOCK_N, DV]."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays zeros
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc, m_new, l * alpha + tl.sum(p, axis=1)


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
def _merge(PM, PL, PACC, first, count, HP: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(o [HP, BLOCK_DV], m, l) of partials first .. first + count - 1 merged; o is 0 where nothing was visible."""
    h = tl.arange(0, HP)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    for i in range(count):
        row = first + i
        m_i = tl.load(PM + row * HP + h)
        m_new = tl.maximum(m, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_i - m_safe)
        acc = acc * alpha[:, None] + tl.load(PACC + (row * HP + h)[:, None] * BLOCK_DV + dv[None, :]) * beta[:, None]
        l = l * alpha + tl.load(PL + row * HP + h) * beta
        m = m_new
    return acc / tl.where(l > 0, l, 1.0)[:, None], m, l


@triton.jit
def nsa_decode_cmp_kernel(Q, KC, VC, POS, PM, PL, PACC, sqb, sqh, scb, sct, scg, svcb, svct, svcg, qk_scale,
                          G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                          CHUNK: tl.constexpr, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    pid, c = tl.program_id(0), tl.program_id(1)
    b, g = pid // G, pid % G
    nc = _visible_slots(tl.load(POS), CMP_BLOCK, CMP_STRIDE)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for s0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, nc), BLOCK_N):
        t = s0 + offs
        ok = t < nc
        s = _scores(q, _rows(KC, b, t, g, scb, sct, scg, ok, DK, BLOCK_DK), ok, qk_scale)
        acc, m, l = _online(acc, m, l, s, _rows(VC, b, t, g, svcb, svct, svcg, ok, DV, BLOCK_DV))
    _store_partial(PM, PL, PACC, pid.to(tl.int64) * tl.num_programs(1) + c, acc, m, l, HP, BLOCK_DV)


@triton.jit
def nsa_decode_importance_kernel(Q, KC, POS, PM, PL, IMP, sqb, sqh, scb, sct, scg, qk_scale,
                                 G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr,
                                 BLOCK_DK: tl.constexpr, CHUNK: tl.constexpr, CMP_BLOCK: tl.constexpr,
                                 CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr, NB_PAD: tl.constexpr,
                                 TILE_BLOCKS: tl.constexpr):
    pid, c = tl.program_id(0), tl.program_id(1)
    b, g = pid // G, pid % G
    nc = _visible_slots(tl.load(POS), CMP_BLOCK, CMP_STRIDE)
    if c * CHUNK >= nc:
        return
    # each head's log2-domain lse, from the compressed partials of every chunk
    h = tl.arange(0, HP)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    for i in range(tl.num_programs(1)):
        row = pid.to(tl.int64) * tl.num_programs(1) + i
        m_i = tl.load(PM + row * HP + h)
        m_new = tl.maximum(m, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.load(PL + row * HP + h) * tl.exp2(m_i - m_safe)
        m = m_new
    row_ok = (h < HPG) & (l > 0)
    lse2 = tl.where(row_ok, m + tl.log2(tl.where(l > 0, l, 1.0)), 0.0)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    PER_BLOCK: tl.constexpr = SEL_BLOCK // CMP_STRIDE
    PER_TOKEN: tl.constexpr = CMP_BLOCK // CMP_STRIDE
    TOKENS: tl.constexpr = TILE_BLOCKS * PER_BLOCK
    start = tl.arange(0, PER_BLOCK)  # where in its block a token starts
    w_own = tl.minimum(PER_BLOCK - start, PER_TOKEN).to(tl.float32)
    w_spill = tl.maximum(start + PER_TOKEN - PER_BLOCK, 0).to(tl.float32)
    imp = IMP + pid.to(tl.int64) * 2 * NB_PAD
    tok = tl.arange(0, TOKENS)
    for t0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, nc), TOKENS):  # CHUNK: whole blocks of tokens
        t = t0 + tok
        ok = t < nc
        s = _scores(q, _rows(KC, b, t, g, scb, sct, scg, ok, DK, BLOCK_DK), ok, qk_scale)
        p = tl.where(row_ok[:, None] & ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        p3 = tl.reshape(tl.sum(p, axis=0), [TILE_BLOCKS, PER_BLOCK])
        blk = t0 // PER_BLOCK + tl.arange(0, TILE_BLOCKS)
        tl.store(imp + blk, tl.sum(p3 * w_own[None, :], axis=1), mask=blk < NB_PAD)
        tl.store(imp + NB_PAD + blk, tl.sum(p3 * w_spill[None, :], axis=1), mask=blk < NB_PAD)


@triton.jit
def nsa_decode_attend_kernel(Q, KS, VS, KW, VW, POS, IMP, BLOCKS, PM, PL, PACC,
                             sqb, sqh, skb, skt, skg, svb, svt, svg, swkb, swkt, swkg, swvb, swvt, swvg,
                             num_blocks, qk_scale,
                             G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr,
                             DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                             CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
                             N_SEL: tl.constexpr, N_PAD: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                             WINDOW: tl.constexpr, WIN_TILE: tl.constexpr, NB_PAD: tl.constexpr):
    pid, part = tl.program_id(0), tl.program_id(1)
    b, g = pid // G, pid % G
    pos = tl.load(POS)
    q = _query(Q, b, g, sqb, sqh, HPG, HP, DK, BLOCK_DK)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    if part < N_SEL:
        # top-n, in every program of the selected branch (a few reductions over the blocks' importance)
        touched = tl.cdiv(_visible_slots(pos, CMP_BLOCK, CMP_STRIDE), SEL_BLOCK // CMP_STRIDE)
        j = tl.arange(0, NB_PAD)
        imp = IMP + pid.to(tl.int64) * 2 * NB_PAD
        importance = tl.load(imp + j, mask=j < touched, other=0.0)
        importance += tl.load(imp + NB_PAD + j - 1, mask=(j >= 1) & (j - 1 < touched), other=0.0)
        candidate = (j < num_blocks) & (j * SEL_BLOCK <= pos)
        forced = candidate & ((j < N_INIT) | ((j + N_LOCAL) * SEL_BLOCK > pos))
        key = tl.where(forced, float("inf"), tl.where(candidate, importance, float("-inf")))
        slot = tl.arange(0, N_PAD)
        chosen = tl.full([N_PAD], -1, tl.int32)
        for i in tl.static_range(N_SEL):
            top = tl.max(key, axis=0)
            first = tl.min(tl.where(key == top, j, NB_PAD), axis=0)
            chosen = tl.where(slot == i, tl.where(top > float("-inf"), first, -1), chosen)
            key = tl.where(j == first, float("-inf"), key)
        if part == 0:  # the step's blocks, ascending, -1 padded
            ascending = tl.sort(tl.where(chosen < 0, NB_PAD, chosen), dim=0)
            tl.store(BLOCKS + pid.to(tl.int64) * N_SEL + slot, tl.where(ascending == NB_PAD, -1, ascending),
                     mask=slot < N_SEL)
        block = tl.sum(tl.where(slot == part, chosen, 0), axis=0)
        for k0 in range(0, SEL_BLOCK, BLOCK_N):
            t = block * SEL_BLOCK + k0 + offs
            ok = (block >= 0) & (k0 + offs < SEL_BLOCK) & (t <= pos)
            s = _scores(q, _rows(KS, b, t, g, skb, skt, skg, ok, DK, BLOCK_DK), ok, qk_scale)
            acc, m, l = _online(acc, m, l, s, _rows(VS, b, t, g, svb, svt, svg, ok, DV, BLOCK_DV))
    else:  # one tile of the window, positions max(p - w + 1, 0) .. p
        lo = tl.maximum(pos - WINDOW + 1, 0) + (part - N_SEL) * WIN_TILE
        for t0 in range(lo, tl.minimum(lo + WIN_TILE, pos + 1), BLOCK_N):
            t = t0 + offs
            ok = t <= pos
            s = _scores(q, _rows(KW, b, t, g, swkb, swkt, swkg, ok, DK, BLOCK_DK), ok, qk_scale)
            acc, m, l = _online(acc, m, l, s, _rows(VW, b, t, g, swvb, swvt, swvg, ok, DV, BLOCK_DV))
    _store_partial(PM, PL, PACC, pid.to(tl.int64) * tl.num_programs(1) + part, acc, m, l, HP, BLOCK_DV)


@triton.jit
def nsa_decode_combine_kernel(CM, CL, CACC, SM, SL, SACC, GATES, O, chunks, sgb, sgh,
                              G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DV: tl.constexpr, N_SEL: tl.constexpr, WIN_TILES: tl.constexpr):
    pid = tl.program_id(0)
    b, g = pid // G, pid % G
    parts = N_SEL + WIN_TILES
    o_cmp, _, _ = _merge(CM, CL, CACC, pid.to(tl.int64) * chunks, chunks, HP, BLOCK_DV)
    o_slc, _, _ = _merge(SM, SL, SACC, pid.to(tl.int64) * parts, N_SEL, HP, BLOCK_DV)
    o_win, _, _ = _merge(SM, SL, SACC, pid.to(tl.int64) * parts + N_SEL, WIN_TILES, HP, BLOCK_DV)
    rows = tl.arange(0, HP)
    row_ok = rows < HPG
    heads = g * HPG + rows
    gate_ptrs = GATES + b.to(tl.int64) * sgb + heads * sgh
    g_cmp = tl.load(gate_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(gate_ptrs + 1, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate_ptrs + 2, mask=row_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * o_cmp + g_slc[:, None] * o_slc + g_win[:, None] * o_win
    dv = tl.arange(0, BLOCK_DV)
    o_ptrs = O + (b.to(tl.int64) * G * HPG + heads)[:, None] * DV + dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
