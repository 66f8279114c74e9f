"""NSA's decoding step in one kernel: one new query per (batch, kv group) over a model's cached buffers.

The same function as ops/decode.py's PyTorch step (NSA_SPEC.md sections 1-7 at the query's position p), which a
decoding step otherwise runs as about a hundred small kernels a layer; their launches, not their work, were the
step's time on an H200 (v67: 5.5 ms of GPU time a token at nsa-125m, 12 layers). One program holds the group's
heads (HP rows, HPG of them real) and walks, in order:

  1. the visible compressed slots (i < Nc(p)): an online softmax gives o_cmp and each head's lse;
  2. the same slots again: p_cmp = exp(s - lse) summed over the heads, folded into block importance by the banded
     overlap (a token starts in one block and spills into at most the next; PER_BLOCK = l'/d tokens start in each
     block, a power of two), written to a scratch row: own[j] and spill[j], read back after a barrier as
     importance[j] = own[j] + spill[j - 1];
  3. top-n: forced blocks get +inf, non-candidates -inf; N_SEL rounds of "largest key, lowest index among equals"
     (the spec's tie rule, as the stable sort of the other paths);
  4. the chosen blocks' keys up to p, then the window's last w keys, each by an online softmax;
  5. the gated sum, stored, and the chosen blocks, ascending, -1 padded.

Scores are products summed in fp32 registers ([HP, BLOCK_N, D] at a time, no tl.dot: a decoding step's rows are
few), exponentials exp2 of log2-scaled scores. The position is read from a tensor, so a CUDA graph of the step
serves every position. Buffers: [B, L, G, D] raw keys/values and [B, S, G, D] compressed slots, each with the
last dim contiguous (strides passed); q [B, H, Dk] and gates [B, H, 3] with their last dim contiguous.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _rows(X, b, t, g, sb, st, sg, ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """[len(t), BLOCK_D] fp32 rows of buffer X at positions t of (b, g); zeros where not ok."""
    d = tl.arange(0, BLOCK_D)
    ptrs = X + b.to(tl.int64) * sb + t.to(tl.int64)[:, None] * st + g * sg + d[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)


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
def _finish(acc, l):
    return acc / tl.where(l > 0, l, 1.0)[:, None]


@triton.jit
def nsa_decode_kernel(Q, KS, VS, KW, VW, KC, VC, GATES, POS, O, BLOCKS, SCRATCH,
                      sqb, sqh, skb, skt, skg, svb, svt, svg, swkb, swkt, swkg, swvb, swvt, swvg,
                      scb, sct, scg, svcb, svct, svcg, sgb, sgh, num_blocks, qk_scale,
                      G: tl.constexpr, HPG: tl.constexpr, HP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
                      N_SEL: tl.constexpr, N_PAD: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                      WINDOW: tl.constexpr, NB_PAD: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // G
    g = pid % G
    pos = tl.load(POS)
    rows = tl.arange(0, HP)
    row_ok = rows < HPG
    heads = g * HPG + rows
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * sqb + heads[:, None] * sqh + dk[None, :],
                mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)
    offs = tl.arange(0, BLOCK_N)

    # 1. compressed branch: slots i with i*d + l - 1 <= p
    nc = tl.where(pos + 1 >= CMP_BLOCK, (pos + 1 - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    for s0 in range(0, nc, BLOCK_N):
        t = s0 + offs
        ok = t < nc
        s = _scores(q, _rows(KC, b, t, g, scb, sct, scg, ok, DK, BLOCK_DK), ok, qk_scale)
        acc, m, l = _online(acc, m, l, s, _rows(VC, b, t, g, svcb, svct, svcg, ok, DV, BLOCK_DV))
    o_cmp = _finish(acc, l)
    lse2 = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), 0.0)

    # 2. block importance: own[j] (tokens starting in block j) and spill[j] (their share of block j + 1)
    PER_BLOCK: tl.constexpr = SEL_BLOCK // CMP_STRIDE
    PER_TOKEN: tl.constexpr = CMP_BLOCK // CMP_STRIDE
    TOKENS: tl.constexpr = TILE_BLOCKS * PER_BLOCK
    start = tl.arange(0, PER_BLOCK)
    w_own = tl.minimum(PER_BLOCK - start, PER_TOKEN).to(tl.float32)
    w_spill = tl.maximum(start + PER_TOKEN - PER_BLOCK, 0).to(tl.float32)
    scratch = SCRATCH + pid.to(tl.int64) * 2 * NB_PAD
    tok = tl.arange(0, TOKENS)
    for t0 in range(0, nc, TOKENS):
        t = t0 + tok
        ok = t < nc
        s = _scores(q, _rows(KC, b, t, g, scb, sct, scg, ok, DK, BLOCK_DK), ok, qk_scale)
        p = tl.where(row_ok[:, None] & ok[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        p3 = tl.reshape(tl.sum(p, axis=0), [TILE_BLOCKS, PER_BLOCK])
        blk = t0 // PER_BLOCK + tl.arange(0, TILE_BLOCKS)
        tl.store(scratch + blk, tl.sum(p3 * w_own[None, :], axis=1), mask=blk < NB_PAD)
        tl.store(scratch + NB_PAD + blk, tl.sum(p3 * w_spill[None, :], axis=1), mask=blk < NB_PAD)
    tl.debug_barrier()  # the scratch row, written by every thread of the program, read back by every thread

    # 3. top-n
    touched = tl.cdiv(nc, PER_BLOCK)  # blocks some visible token starts in
    j = tl.arange(0, NB_PAD)
    imp = tl.load(scratch + j, mask=j < touched, other=0.0)
    imp += tl.load(scratch + NB_PAD + j - 1, mask=(j >= 1) & (j - 1 < touched), other=0.0)
    candidate = (j < num_blocks) & (j * SEL_BLOCK <= pos)
    forced = candidate & ((j < N_INIT) | ((j + N_LOCAL) * SEL_BLOCK > pos))
    key = tl.where(forced, float("inf"), tl.where(candidate, imp, float("-inf")))
    slot = tl.arange(0, N_PAD)
    chosen = tl.full([N_PAD], -1, tl.int32)
    for i in tl.static_range(N_SEL):
        top = tl.max(key, axis=0)
        first = tl.min(tl.where(key == top, j, NB_PAD), axis=0)
        chosen = tl.where(slot == i, tl.where(top > float("-inf"), first, -1), chosen)
        key = tl.where(j == first, float("-inf"), key)

    # 4. the chosen blocks' keys up to p, then the window
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    for i in range(N_SEL):
        block = tl.sum(tl.where(slot == i, chosen, 0), axis=0)
        for k0 in range(0, SEL_BLOCK, BLOCK_N):
            t = block * SEL_BLOCK + k0 + offs
            ok = (block >= 0) & (k0 + offs < SEL_BLOCK) & (t <= pos)
            s = _scores(q, _rows(KS, b, t, g, skb, skt, skg, ok, DK, BLOCK_DK), ok, qk_scale)
            acc, m, l = _online(acc, m, l, s, _rows(VS, b, t, g, svb, svt, svg, ok, DV, BLOCK_DV))
    o_slc = _finish(acc, l)
    acc = tl.zeros([HP, BLOCK_DV], tl.float32)
    m = tl.full([HP], float("-inf"), tl.float32)
    l = tl.zeros([HP], tl.float32)
    for t0 in range(tl.maximum(pos - WINDOW + 1, 0), pos + 1, BLOCK_N):
        t = t0 + offs
        ok = t <= pos
        s = _scores(q, _rows(KW, b, t, g, swkb, swkt, swkg, ok, DK, BLOCK_DK), ok, qk_scale)
        acc, m, l = _online(acc, m, l, s, _rows(VW, b, t, g, swvb, swvt, swvg, ok, DV, BLOCK_DV))
    o_win = _finish(acc, l)

    # 5. gates, output, blocks
    gate_ptrs = GATES + b.to(tl.int64) * sgb + heads * sgh
    g_cmp = tl.load(gate_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(gate_ptrs + 1, mask=row_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate_ptrs + 2, mask=row_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * o_cmp + g_slc[:, None] * o_slc + g_win[:, None] * o_win
    o_ptrs = O + (b.to(tl.int64) * G * HPG + heads)[:, None] * DV + dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :])
    ascending = tl.sort(tl.where(chosen < 0, NB_PAD, chosen), dim=0)
    tl.store(BLOCKS + pid.to(tl.int64) * N_SEL + slot, tl.where(ascending == NB_PAD, -1, ascending),
             mask=slot < N_SEL)
