"""Sums behind NSAAttention's per-call statistics (gate means, selected blocks per query, their distance), one pass.

Each program reads its share of the selections blocks [B, T, G, n] (int32, -1 = empty slot) and of the gates
[B * T * H, 3] and stores five float32 sums: the three gates, the number of chosen slots and the sum of their
distances in blocks from the query's own block (t // l' - block). The caller adds the programs' rows up (a few
hundred values; torch.compile fuses that with the division into the means). As PyTorch ops these statistics
were about seven inductor reductions a layer call, most of them a few microseconds of launch each: 0.5 ms of the
T = 8192 training step on nsa-125m (kernels-notes.md v41).

Layouts (contiguous): BLOCKS [num_slots], slot = ((b * T + t) * G + g) * N + i; GATES [num_rows, 3];
PARTS [programs, 5] float32.
"""

import triton
import triton.language as tl


@triton.jit
def attention_stats_kernel(BLOCKS, GATES, PARTS, num_slots, num_rows, T, slots_per_program, rows_per_program,
                           G: tl.constexpr, N: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    chosen = tl.zeros([BLOCK], tl.float32)
    distance = tl.zeros([BLOCK], tl.float32)
    first = pid * slots_per_program
    last = tl.minimum(first + slots_per_program, num_slots)
    for s0 in range(first, last, BLOCK):
        slot = s0 + offs
        ok = slot < last
        block = tl.load(BLOCKS + slot, mask=ok, other=-1)
        t = (slot // (G * N)) % T
        used = block >= 0
        chosen += used.to(tl.float32)
        distance += tl.where(used, (t // SEL_BLOCK - block).to(tl.float32), 0.0)

    offs_r = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, 4)  # the three gates, padded to a power of two
    gate_sum = tl.zeros([BLOCK_R, 4], tl.float32)
    first_row = pid * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, num_rows)
    for r0 in range(first_row, last_row, BLOCK_R):
        row = r0 + offs_r
        ok = (row < last_row)[:, None] & (cols < 3)[None, :]
        gate_sum += tl.load(GATES + row[:, None] * 3 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    gates = tl.sum(gate_sum, axis=0)  # [4], the last one 0

    at = PARTS + pid * 5
    tl.store(at + cols, gates, mask=cols < 3)
    tl.store(at + 3, tl.sum(chosen, axis=0))
    tl.store(at + 4, tl.sum(distance, axis=0))
