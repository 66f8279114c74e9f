"""Block importance (NSA_SPEC.md section 3) and top-n selection (section 4), fused in one pass.

One program owns BLOCK_M queries of one (batch, kv group). It walks the selection blocks in chunks of
CHUNK_BLOCKS = N_PAD * 2^CHUNK_SPLITS blocks (larger chunks reload the group's query tiles fewer times); for each
chunk it recomputes p_cmp = exp(s * q.k_cmp - lse) for the compressed tokens that start in the chunk, summed over
the group's heads, turns it into block importance with one small matmul against the overlap weights W (integers,
computed from indices), and merges the chunk into a running top-N_PAD list. No T x Tc score or T x (T / l')
importance ever reaches memory. W is banded (a token overlaps its own block and at most the next), so where l'/d
is a power of 2 the importance is a per-block sum of the tokens grouped by a reshape plus one neighbour's spill
(_banded_importance); elsewhere the matmul, in full fp32 ("ieee"): tf32x3 on the matrix units ran 8-20% slower
(v32). The visibility mask is applied once to the group's summed p, not per head (v35: together about 25% fewer
instructions a chunk, SASS compiled offline). The exponential is exp2 of scores and lse both scaled by log2(e) beforehand, one ex2.approx.ftz
each: fp32 `exp` lowers to a non-flushing ex2 that ptxas wraps in a denormal check (three FMA-pipe instructions
more), which bound this kernel (192.6 -> 147.4 us at 125M 4 x 8k on the H100, kernels-notes.md v34). A
polynomial on the FMA pipe for a quarter or half of the exponentials (FlashAttention-4's device) was slower again
(bench/probe_exp2.py).

Ordering: each (query, block) gets one int64 key = (float bits of importance) << 32 | (2^31 - 1 - block), so a
larger key means more important, and among equal importance the lower block index. Forced blocks get the bits of
+inf (always chosen); non-candidates (block start after t) get key -1 (never chosen over a candidate, decoded to
-1). A chunk's keys sorted ascending are halved CHUNK_SPLITS times, keeping the upper half, down to its top
N_PAD. Merge of a running list sorted descending with a chunk's top sorted ascending: the elementwise maximum
holds the top N_PAD of their union (a bitonic split) as a bitonic sequence, which log2(N_PAD) compare-exchange
steps order again (_merge_descending; a full sort took 10 steps at N_PAD = 16 and 11% of the kernel at 125M
4 x 8k on the H200, kernels-notes.md v32).

TMA (constexpr): the q and compressed-key tiles come in through tensor descriptors (QD, KCD), as in
range_attention.py; rows they read past a sequence's end are masked out of the scores (vis).

A compressed token that starts before the chunk overlaps at most the chunk's first block (l <= l'); its share
is carried from the previous chunk (`carry`).
"""

import triton
import triton.language as tl

from nsa_model.kernels.range_attention import _query_tile_index

INF_BITS = tl.constexpr(0x7F800000)  # float32 +inf as int32
INDEX_MAX = tl.constexpr(2147483647)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _overlap(piece, block, PIECES_PER_TOKEN: tl.constexpr, PIECES_PER_BLOCK: tl.constexpr):
    """W of spec section 3: pieces (length d) shared by the token starting at `piece` and block `block`."""
    lo = tl.maximum(piece, block * PIECES_PER_BLOCK)
    hi = tl.minimum(piece + PIECES_PER_TOKEN, (block + 1) * PIECES_PER_BLOCK)
    return tl.maximum(hi - lo, 0)


@triton.jit
def _banded_importance(p, BLOCK_M: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, PIECES_PER_TOKEN: tl.constexpr,
                       PIECES_PER_BLOCK: tl.constexpr):
    """(own, spill) [BLOCK_M, CHUNK_BLOCKS] of a chunk's token probabilities p [BLOCK_M, CHUNK_BLOCKS * l'/d]:
    W is banded. Token i starts at piece i and covers l/d <= l'/d pieces, so it overlaps its own block (the one
    it starts in) and at most the next one; own[:, j] sums the tokens starting in block j weighted by their
    overlap with it, spill[:, j] the same tokens weighted by their overlap with block j + 1. Importance of block
    j is own[:, j] + spill[:, j - 1]. Grouping the tokens by block is a reshape when l'/d is a power of 2; it
    replaces the [BLOCK_M, tokens] x [tokens, blocks] fp32 matmul (on the FMA pipe: 512 FFMA and 128 shared
    loads per thread a chunk at nsa-125m) with a few multiply-adds per token."""
    p3 = tl.reshape(p, [BLOCK_M, CHUNK_BLOCKS, PIECES_PER_BLOCK])
    start = tl.arange(0, PIECES_PER_BLOCK)  # piece of the block the token starts at
    w_own = _overlap(start, 0, PIECES_PER_TOKEN, PIECES_PER_BLOCK).to(tl.float32)
    w_next = _overlap(start, 1, PIECES_PER_TOKEN, PIECES_PER_BLOCK).to(tl.float32)
    own = tl.sum(p3 * w_own[None, None, :], axis=2)
    spill = tl.sum(p3 * w_next[None, None, :], axis=2)
    return own, spill


@triton.jit
def _merge_descending(x, BLOCK_M: tl.constexpr, N: tl.constexpr):
    """x [BLOCK_M, N] with each row bitonic (descending, then ascending) -> each row sorted descending: for
    stride N/2, N/4, .., 1 every pair (i, i + stride) with i & stride = 0 gets the larger value at i. The row is
    viewed as a hypercube of N = 2^LOG_N, one size-2 axis per stride, and an element's partner along an axis is
    its value XOR the axis's XOR-reduction: no data leaves the registers' layout (v32)."""
    LOG_N: tl.constexpr = N.bit_length() - 1
    h = tl.reshape(x, [BLOCK_M] + [2] * LOG_N)
    for k in tl.static_range(LOG_N):  # axis 1 + k holds stride N >> (k + 1)
        partner = h ^ tl.xor_sum(h, axis=1 + k, keep_dims=True)
        right = tl.reshape(tl.arange(0, 2), [1] * (1 + k) + [2] + [1] * (LOG_N - 1 - k))
        h = tl.where(right == 1, tl.minimum(h, partner), tl.maximum(h, partner))
    return tl.reshape(h, [BLOCK_M, N])


@triton.jit
def select_blocks_kernel(Q, KC, QD, KCD, LSE, BLOCKS, T, num_cmp, scale,
                         H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr,
                         CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
                         N_SELECT: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, CHUNK_SPLITS: tl.constexpr,
                         TOK_PAD: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = _query_tile_index()  # reversed: a later tile walks more blocks, so the longest programs start first
    pid_bg = tl.program_id(1)
    b = pid_bg // G
    g = pid_bg % G
    HPG: tl.constexpr = H // G
    PIECES_PER_TOKEN: tl.constexpr = CMP_BLOCK // CMP_STRIDE
    PIECES_PER_BLOCK: tl.constexpr = SEL_BLOCK // CMP_STRIDE
    CHUNK_BLOCKS: tl.constexpr = N_PAD * (1 << CHUNK_SPLITS)
    TOKENS_PER_CHUNK: tl.constexpr = CHUNK_BLOCKS * PIECES_PER_BLOCK
    BANDED: tl.constexpr = TOK_PAD == TOKENS_PER_CHUNK  # l' / d a power of 2 (see _banded_importance)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < T
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_i = tl.arange(0, TOK_PAD)  # token within the chunk; token i starts at piece i (pieces are d long)
    offs_j = tl.arange(0, CHUNK_BLOCKS)  # block within the chunk
    n_visible = tl.where(offs_m + 1 >= CMP_BLOCK, (offs_m + 1 - CMP_BLOCK) // CMP_STRIDE + 1, 0)  # Nc(t)
    current = offs_m // SEL_BLOCK
    t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    num_candidates = t_last // SEL_BLOCK + 1

    # Overlap weights are the same for every chunk (relative indices).
    weights = _overlap(offs_i[:, None], offs_j[None, :], PIECES_PER_TOKEN, PIECES_PER_BLOCK).to(tl.float32)
    weights = tl.where((offs_i < TOKENS_PER_CHUNK)[:, None], weights, 0.0)
    carry_weights = _overlap(offs_i, CHUNK_BLOCKS, PIECES_PER_TOKEN, PIECES_PER_BLOCK).to(tl.float32)
    carry_weights = tl.where(offs_i < TOKENS_PER_CHUNK, carry_weights, 0.0)

    top = tl.full([BLOCK_M, N_PAD], -1, tl.int64)
    carry = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, num_candidates, CHUNK_BLOCKS):
        tok = j0 * PIECES_PER_BLOCK + offs_i
        tok_ok = (offs_i < TOKENS_PER_CHUNK) & (tok < num_cmp)
        if TMA:
            kc = KCD.load([b * num_cmp + j0 * PIECES_PER_BLOCK, g * DK])
        else:
            row_k = (b * num_cmp + tok).to(tl.int64) * G + g
            kc = tl.load(KC + row_k[:, None] * DK + offs_dk[None, :], mask=tok_ok[:, None] & (offs_dk < DK)[None, :],
                         other=0.0)
        vis = (tok[None, :] < n_visible[:, None]) & tok_ok[None, :] & m_ok[:, None]
        p_sum = tl.zeros([BLOCK_M, TOK_PAD], tl.float32)
        for head in range(HPG):
            row_q = (b * T + offs_m).to(tl.int64) * H + g * HPG + head
            if TMA:
                q = QD.load([b * T + pid_m * BLOCK_M, (g * HPG + head) * DK])
            else:
                q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=m_ok[:, None] & (offs_dk < DK)[None, :],
                            other=0.0)
            lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
            s2 = tl.dot(q, tl.trans(kc), input_precision=DOT_PRECISION) * (scale * LOG2E)
            p_sum += tl.exp2(s2 - lse2[:, None])
        # masked once for the group's heads, not per head: invisible entries may be inf (scores past t), never
        # NaN (scores and lse are finite, or lse is -inf for a row that sees no token), and only visible ones stay
        p_sum = tl.where(vis, p_sum, 0.0)
        if BANDED:
            imp, spill = _banded_importance(p_sum, BLOCK_M, CHUNK_BLOCKS, PIECES_PER_TOKEN, PIECES_PER_BLOCK)
            prev = tl.gather(spill, tl.broadcast_to(tl.maximum(offs_j - 1, 0)[None, :], [BLOCK_M, CHUNK_BLOCKS]), 1)
            imp += tl.where(offs_j[None, :] == 0, carry[:, None], prev)
            carry = tl.sum(tl.where(offs_j[None, :] == CHUNK_BLOCKS - 1, spill, 0.0), axis=1)
        else:
            imp = tl.dot(p_sum, weights, input_precision="ieee")  # exact: weights are small integers
            imp += tl.where(offs_j[None, :] == 0, carry[:, None], 0.0)
            carry = tl.sum(p_sum * carry_weights[None, :], axis=1)

        blk = j0 + offs_j
        cand = (blk[None, :] * SEL_BLOCK) <= offs_m[:, None]
        forced = cand & ((blk[None, :] < N_INIT) | (blk[None, :] > current[:, None] - N_LOCAL))
        bits = tl.where(forced, INF_BITS, imp.to(tl.int32, bitcast=True))
        key = (bits.to(tl.int64) << 32) | (INDEX_MAX - blk.to(tl.int64)[None, :])
        key = tl.where(cand, key, -1)
        chunk_top = tl.sort(key, dim=1)
        for i in tl.static_range(CHUNK_SPLITS):  # keep the upper (larger) half, still ascending
            halves = tl.permute(tl.reshape(chunk_top, [BLOCK_M, 2, CHUNK_BLOCKS >> (i + 1)]), (0, 2, 1))
            _, chunk_top = tl.split(halves)
        top = _merge_descending(tl.maximum(top, chunk_top), BLOCK_M, N_PAD)

    chosen = tl.where(top >= 0, (0 - (top & 0x7FFFFFFF)) + INDEX_MAX, -1).to(tl.int32)
    row_b = (b * T + offs_m).to(tl.int64) * G + g
    offs_n = tl.arange(0, N_PAD)
    tl.store(BLOCKS + row_b[:, None] * N_SELECT + offs_n[None, :], chosen,
             mask=m_ok[:, None] & (offs_n < N_SELECT)[None, :])
