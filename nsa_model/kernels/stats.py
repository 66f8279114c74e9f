"""Sums behind NSAAttention's per-call statistics (gate means, selected blocks per query, their distance), one pass.

Each program reads its share of the selections blocks [B, T, G, n] (int32, -1 = empty slot) and of the gates
[B * T * H, 3] and stores five float32 sums: the three gates, the number of chosen slots and the sum of their
distances in blocks from the query's own block (t // l' - block). The caller adds the programs' rows up (a few
hundred values; torch.compile fuses that with the division into the means). As PyTorch ops these statistics
were about seven inductor reductions a layer call, most of them a few microseconds of launch each: 0.5 ms of the
T = 8192 training step on nsa-125m (kernels-notes.md v41).

Layouts (contiguous): BLOCKS [num_slots], slot = ((b * T + t) * G + g) * N + i; GATES [num_gates], element
row * 3 + branch; PARTS [programs, 5] float32. About a thousand programs, each a step or two: a DRAM pass of a few
megabytes wants that many loads in flight (128 programs of eight steps took 16 us a call at 4 x 8k on the H200, v41).
"""

import triton
import triton.language as tl


@triton.jit
def attention_stats_kernel(BLOCKS, GATES, PARTS, num_slots, num_gates, T, slots_per_program, gates_per_program,
                           G: tl.constexpr, N: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                           BLOCK_G: tl.constexpr):
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

    # the gates as a flat [num_rows * 3] run, loaded contiguously (a [rows, 3] tile would load element by element)
    offs_g = tl.arange(0, BLOCK_G)
    gate_sums = tl.zeros([BLOCK_G, 4], tl.float32)  # by column of the gates, padded to a power of two
    cols = tl.arange(0, 4)
    first_gate = pid * gates_per_program
    last_gate = tl.minimum(first_gate + gates_per_program, num_gates)
    for e0 in range(first_gate, last_gate, BLOCK_G):
        element = e0 + offs_g
        g = tl.load(GATES + element, mask=element < last_gate, other=0.0).to(tl.float32)
        gate_sums += tl.where((element % 3)[:, None] == cols[None, :], g[:, None], 0.0)
    gates = tl.sum(gate_sums, axis=0)  # [4], the last one 0

    at = PARTS + pid * 5
    tl.store(at + cols, gates, mask=cols < 3)
    tl.store(at + 3, tl.sum(chosen, axis=0))
    tl.store(at + 4, tl.sum(distance, axis=0))
