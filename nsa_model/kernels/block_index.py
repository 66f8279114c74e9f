"""The selected branch's indexes, built from the selections blocks [B, T, G, n] (int32, -1 for an empty slot).

Each was a chain of PyTorch ops: about 35 small launches per layer call in the forward, about 2.4 ms per
training step of nsa-125m at T = 2048 besides the sort (kernels-notes.md, v19). Four kernels do their work now:

  segment_ids_kernel  each slot's segment s = (b * G + g) * num_blocks + block (num_segments for an empty slot),
                      the key of the stable sort that builds by_block's inverted index
  segment_starts_kernel  from the sorted keys, each segment's first entry (starts)
  block_work_kernel   from the starts, the work list: program p of the by_block kernels takes chunk
                      work_chunk[p] of segment work_seg[p] (-1: nothing)
  tile_union_kernel   for each tile of TILE_Q consecutive queries, the distinct blocks they chose, ascending,
                      and their count (the tiled kernels walk it)

Offsets are int64 wherever B * T * G * n slots could pass 2^31.
"""

import triton
import triton.language as tl

ABSENT = tl.constexpr(2 ** 31 - 1)  # a union's padding: after every block id


@triton.jit
def segment_ids_kernel(BLOCKS, SEG, num_entries, T, num_blocks, num_segments, G: tl.constexpr, N: tl.constexpr,
                       BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = e < num_entries
    block = tl.load(BLOCKS + e, mask=ok, other=-1)
    g = (e // N) % G
    b = e // (T * (G * N))
    seg = tl.where(block >= 0, block + (b * G + g) * num_blocks, num_segments)
    tl.store(SEG + e, seg.to(SEG.dtype.element_ty), mask=ok)


@triton.jit
def segment_starts_kernel(SORTED, STARTS, num_entries, num_segments, BLOCK: tl.constexpr):
    """starts[s] = the first position of SORTED (ascending, length num_entries) whose key is >= s, for s = 0 ..
    num_segments: one pass over the keys, each position e writing the segments from its predecessor's key + 1 up
    to its own (position num_entries stands past the end). A binary search per segment, in one program, took
    34 us per layer call at 125M 16 x 2k (its 21 dependent loads), this about 3 us."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cur = tl.load(SORTED + e, mask=e < num_entries, other=num_segments).to(tl.int32)
    prev = tl.load(SORTED + e - 1, mask=(e > 0) & (e <= num_entries), other=-1).to(tl.int32)
    gap = tl.where(e <= num_entries, cur - prev, 0)  # segments that start at e: prev + 1 .. cur
    for k in range(0, tl.max(gap, 0)):
        tl.store(STARTS + prev + 1 + k, e, mask=k < gap)


@triton.jit
def block_work_kernel(STARTS, WORK_SEG, WORK_CHUNK, num_segments, num_work, CHUNK: tl.constexpr,
                      BLOCK_S: tl.constexpr):
    """One program: segment s's cdiv(count, CHUNK) chunks, at least one (an empty segment's item writes its
    block's zero gradient), are consecutive work items, segment after segment (count = starts[s + 1] -
    starts[s]); the work list's spare items (it is sized from shapes alone) get segment -1."""
    total = 0
    for s0 in range(0, num_segments, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < num_segments
        count = tl.load(STARTS + s + 1, mask=ok, other=0) - tl.load(STARTS + s, mask=ok, other=0)
        chunks = tl.where(ok, tl.maximum((count + CHUNK - 1) // CHUNK, 1), 0)
        item = total + tl.cumsum(chunks, 0) - chunks  # the segment's first work item
        for c in range(0, tl.max(chunks, 0)):
            has = c < chunks
            tl.store(WORK_SEG + item + c, s, mask=has)
            tl.store(WORK_CHUNK + item + c, tl.zeros_like(s) + c, mask=has)
        total += tl.sum(chunks, 0)
    for w0 in range(total, num_work, BLOCK_S):
        w = w0 + tl.arange(0, BLOCK_S)
        tl.store(WORK_SEG + w, tl.full([BLOCK_S], -1, tl.int32), mask=w < num_work)
        tl.store(WORK_CHUNK + w, tl.zeros([BLOCK_S], tl.int32), mask=w < num_work)


@triton.jit
def tile_union_kernel(BLOCKS, UNION, COUNT, T, num_tiles, G: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr,
                      TILE_Q: tl.constexpr, QUERIES: tl.constexpr, NB_PAD: tl.constexpr, WIDTH: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    """Program (tile, b * G + g): marks the blocks its queries chose, QUERIES queries at a time (a [QUERIES *
    N_PAD, NB_PAD] comparison), then stores each marked block at its rank (a prefix sum over the blocks: no
    sort) and ABSENT after the count. Every block id must be < NB_PAD."""
    tile = tl.program_id(0)
    b = tl.program_id(1) // G
    g = tl.program_id(1) % G
    ids = tl.arange(0, NB_PAD)
    member = tl.zeros([NB_PAD], dtype=tl.int32)
    slot = tl.arange(0, QUERIES * N_PAD)
    for q0 in range(0, TILE_Q, QUERIES):
        q = q0 + slot // N_PAD
        t = tile * TILE_Q + q
        i = slot % N_PAD
        ok = (q < TILE_Q) & (t < T) & (i < N)
        block = tl.load(BLOCKS + ((b * T + t).to(tl.int64) * G + g) * N + i, mask=ok, other=-1)
        member = tl.maximum(member, tl.max((block[:, None] == ids[None, :]).to(tl.int32), axis=0))
    rank = tl.cumsum(member, 0) - 1
    count = tl.sum(member, 0)
    row = ((b * num_tiles + tile) * G + g).to(tl.int64)
    tl.store(UNION + row * WIDTH + rank, ids, mask=member > 0)
    tl.store(COUNT + row, count)
    for p0 in range(0, WIDTH, BLOCK_W):
        p = p0 + tl.arange(0, BLOCK_W)
        tl.store(UNION + row * WIDTH + p, tl.full([BLOCK_W], ABSENT, tl.int32), mask=(p >= count) & (p < WIDTH))
