"""Sums behind NSAAttention's per-call statistics (gate means, selected blocks per query, their distance), one pass.

Each program reads a run of tokens' rows of the selections blocks [B * T, G * n] (int32, -1 = empty slot) and of
the gates [B * T, H * 3] and stores five float32 sums: the three gates, the number of chosen slots and the sum of
their distances in blocks from the query's own block (t // l' - block). The caller adds the programs' rows up
(torch.compile fuses that with the division into the means). As PyTorch ops these statistics were about seven
inductor reductions a layer call, most of them a few microseconds of launch each (kernels-notes.md v41).

Tiles are token rows, so the token's position t is computed once a row: a first form over flat slot indices
spent a 64-bit division per slot and took 13-16 us a call at 125M 4 x 8k on the H200 (v41).

Layouts (contiguous): BLOCKS [num_tokens, SLOTS] (SLOTS = G * n), GATES [num_tokens, GATE_COLS] (GATE_COLS =
H * 3, column h * 3 + branch), PARTS [programs, 5] float32.
"""

import triton
import triton.language as tl


@triton.jit
def attention_stats_kernel(BLOCKS, GATES, PARTS, num_tokens, T, tokens_per_program, SLOTS: tl.constexpr,
                           SLOTS_PAD: tl.constexpr, GATE_COLS: tl.constexpr, GATE_PAD: tl.constexpr,
                           SEL_BLOCK: tl.constexpr, TOKENS: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = tl.arange(0, TOKENS)
    slot = tl.arange(0, SLOTS_PAD)
    col = tl.arange(0, GATE_PAD)
    chosen = tl.zeros([TOKENS, SLOTS_PAD], tl.float32)
    distance = tl.zeros([TOKENS, SLOTS_PAD], tl.float32)
    gate_sums = tl.zeros([TOKENS, GATE_PAD], tl.float32)
    first = pid * tokens_per_program
    last = tl.minimum(first + tokens_per_program, num_tokens)
    for t0 in range(first, last, TOKENS):
        token = t0 + offs_t
        ok = token < last
        row = token.to(tl.int64)
        block = tl.load(BLOCKS + row[:, None] * SLOTS + slot[None, :], mask=ok[:, None] & (slot < SLOTS)[None, :],
                        other=-1)
        used = block >= 0
        own = (token % T) // SEL_BLOCK  # the query's own block
        chosen += used.to(tl.float32)
        distance += tl.where(used, (own[:, None] - block).to(tl.float32), 0.0)
        gate_sums += tl.load(GATES + row[:, None] * GATE_COLS + col[None, :],
                             mask=ok[:, None] & (col < GATE_COLS)[None, :], other=0.0).to(tl.float32)
    by_col = tl.sum(gate_sums, axis=0)
    branch = col % 3
    at = PARTS + pid.to(tl.int64) * 5
    for i in tl.static_range(3):
        tl.store(at + i, tl.sum(tl.where(branch == i, by_col, 0.0), axis=0))
    tl.store(at + 3, tl.sum(tl.sum(chosen, axis=1), axis=0))
    tl.store(at + 4, tl.sum(tl.sum(distance, axis=1), axis=0))
