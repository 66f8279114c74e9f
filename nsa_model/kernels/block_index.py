"""The selected branch's indexes, built from the selections blocks [B, T, G, n] (int32, -1 for an empty slot).

Each was a chain of PyTorch ops: about 35 small launches per layer call in the forward, about 2.4 ms per
training step of nsa-125m at T = 2048 besides the sort (kernels-notes.md, v19). Four kernels do their work now:

  segment_ids_kernel  each slot's segment s = (b * G + g) * num_blocks + block (num_segments for an empty slot),
                      the key of the stable sort that builds by_block's inverted index
  segment_starts_kernel  from the sorted keys, each segment's first entry (starts)
  block_work_kernel   from the starts, the work list: program p of the by_block kernels takes chunk
                      work_chunk[p] of segment work_seg[p] (-1: nothing)
  tile_union_kernel   for each tile of TILE_Q consecutive queries, the distinct blocks they chose, ascending,
                      their count, and for each one a bitmask of the tile's queries that chose it (the tiled
                      kernels walk the union and read a row's membership from the mask)

The inverted index without a sort of all slots (LaunchConfig.index_build "count", which "auto" picks at short T),
three kernels in place of the first three above and PyTorch's radix sort (whose own launches, memsets and int64
order cost about 1.5 ms of the T = 8192 training step, kernels-notes.md v47). A tile is the slots of TILE_Q
consecutive queries of one (b, g), at most ENTRIES of them:

  tile_histogram_kernel  each tile's count of every block (COUNTS [b*G + g, block, tile]) and its total
  segment_offsets_kernel one program per (b, g): prefix sums of the counts over tiles, over blocks and over the
                         (b, g) before it give each segment's start and where each tile's choosers of a block
                         go in it; and that (b, g)'s part of the work list
  tile_scatter_kernel    each tile sorts its slots by (block, slot) in registers and writes each one's flat slot
                         to its place: a block's choosers from earlier tiles come first, so each segment is in
                         query order, as a stable sort leaves it

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
def _bit_or(a, b):
    return a | b


@triton.jit
def tile_union_kernel(BLOCKS, UNION, COUNT, MEMBERS, T, num_tiles, G: tl.constexpr, N: tl.constexpr,
                      N_PAD: tl.constexpr, TILE_Q: tl.constexpr, QUERIES: tl.constexpr, NB_PAD: tl.constexpr,
                      WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (tile, b * G + g): marks the blocks its queries chose, QUERIES queries at a time (a [QUERIES *
    N_PAD, NB_PAD] comparison), each mark a bitmask of the queries (bit q: the tile's query q, TILE_Q <= 64),
    then stores each marked block at its rank (a prefix sum over the blocks: no sort), its mask beside it in
    MEMBERS, and ABSENT after the count. Every block id must be < NB_PAD."""
    tl.static_assert(TILE_Q <= 64, "a tile's membership masks hold at most 64 queries")
    tile = tl.program_id(0)
    b = tl.program_id(1) // G
    g = tl.program_id(1) % G
    ids = tl.arange(0, NB_PAD)
    bits = tl.zeros([NB_PAD], dtype=tl.int64)
    slot = tl.arange(0, QUERIES * N_PAD)
    for q0 in range(0, TILE_Q, QUERIES):
        q = q0 + slot // N_PAD
        t = tile * TILE_Q + q
        i = slot % N_PAD
        ok = (q < TILE_Q) & (t < T) & (i < N)
        block = tl.load(BLOCKS + ((b * T + t).to(tl.int64) * G + g) * N + i, mask=ok, other=-1)
        bit = tl.full([QUERIES * N_PAD], 1, tl.int64) << tl.minimum(q, 63).to(tl.int64)
        hits = tl.where(block[:, None] == ids[None, :], bit[:, None], tl.zeros([1, 1], tl.int64))
        bits = bits | tl.reduce(hits, 0, _bit_or)
    member = (bits != 0).to(tl.int32)
    rank = tl.cumsum(member, 0) - 1
    count = tl.sum(member, 0)
    row = ((b * num_tiles + tile) * G + g).to(tl.int64)
    tl.store(UNION + row * WIDTH + rank, ids, mask=member > 0)
    tl.store(MEMBERS + row * WIDTH + rank, bits, mask=member > 0)
    tl.store(COUNT + row, count)
    for p0 in range(0, WIDTH, BLOCK_W):
        p = p0 + tl.arange(0, BLOCK_W)
        tl.store(UNION + row * WIDTH + p, tl.full([BLOCK_W], ABSENT, tl.int32), mask=(p >= count) & (p < WIDTH))


@triton.jit
def _tile_slots(BLOCKS, b, g, tile, T, num_blocks, G: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr,
                ENTRIES: tl.constexpr):
    """(block, flat slot, valid) [ENTRIES] of the tile's slots: entry e is query tile * (ENTRIES / N_PAD) +
    e // N_PAD, slot e % N_PAD (power-of-two divisors: shifts); an empty or padded slot is not valid."""
    e = tl.arange(0, ENTRIES)
    t = tile * (ENTRIES // N_PAD) + e // N_PAD
    i = e % N_PAD
    ok = (t < T) & (i < N)
    flat = ((b * T + t) * G + g) * N + i  # int32: the caller checks that every flat slot fits
    block = tl.load(BLOCKS + flat, mask=ok, other=-1)
    return block, flat, ok & (block >= 0) & (block < num_blocks)


@triton.jit
def tile_histogram_kernel(BLOCKS, COUNTS, TILE_TOTAL, T, num_blocks, num_tiles, G: tl.constexpr, N: tl.constexpr,
                          N_PAD: tl.constexpr, ENTRIES: tl.constexpr, NB_PAD: tl.constexpr):
    """Program (tile, b * G + g): COUNTS[(b*G + g) * num_blocks + j, tile] = the tile's slots that chose block j;
    TILE_TOTAL[b*G + g, tile] = its valid slots."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    block, _, valid = _tile_slots(BLOCKS, bg // G, bg % G, tile, T, num_blocks, G, N, N_PAD, ENTRIES)
    count = tl.histogram(tl.where(valid, block, 0), NB_PAD, mask=valid)
    j = tl.arange(0, NB_PAD)
    tl.store(COUNTS + (bg * num_blocks + j) * num_tiles + tile, count, mask=j < num_blocks)
    tl.store(TILE_TOTAL + bg * num_tiles + tile, tl.sum(count, 0))


@triton.jit
def segment_offsets_kernel(COUNTS, TILE_TOTAL, OFFSETS, STARTS, WORK_SEG, WORK_CHUNK, num_blocks, num_tiles,
                           num_groups, work_per_group, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                           NT_PAD: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (b*G + g) = s0 / num_blocks, segments s0 .. s0 + num_blocks - 1, ROWS blocks at a time:
    STARTS[s] = where segment s starts in the sorted order (the valid slots of every (b, g) before, then of the
    blocks before); OFFSETS[s, tile] = STARTS[s] + (the tile's choosers of block s that earlier tiles have) - (the
    tile's slots on smaller blocks), so that tile_scatter_kernel's k-th slot in (block, slot) order goes to
    OFFSETS + k. STARTS[num_groups * num_blocks] = every valid slot. The work list as block_work_kernel makes it,
    in this (b, g)'s own part of it, work_per_group items, its spare items -1."""
    bg = tl.program_id(0)
    base = 0
    for p0 in range(0, bg * num_tiles, BLOCK_S):
        p = p0 + tl.arange(0, BLOCK_S)
        base += tl.sum(tl.load(TILE_TOTAL + p, mask=p < bg * num_tiles, other=0), 0)
    tiles = tl.arange(0, NT_PAD)
    below = tl.zeros([NT_PAD], dtype=tl.int32)  # each tile's slots on the blocks before the row chunk
    item = bg * work_per_group  # this (b, g)'s next work item
    for j0 in range(0, num_blocks, ROWS):
        j = j0 + tl.arange(0, ROWS)
        rows_ok = j < num_blocks
        at = (bg * num_blocks + j)[:, None] * num_tiles + tiles[None, :]
        ok = rows_ok[:, None] & (tiles < num_tiles)[None, :]
        counts = tl.load(COUNTS + at, mask=ok, other=0)
        earlier_tiles = tl.cumsum(counts, 1) - counts
        smaller_blocks = below[None, :] + tl.cumsum(counts, 0) - counts
        per_block = tl.sum(counts, 1)
        start = base + tl.cumsum(per_block, 0) - per_block
        tl.store(OFFSETS + at, start[:, None] + earlier_tiles - smaller_blocks, mask=ok)
        tl.store(STARTS + bg * num_blocks + j, start, mask=rows_ok)
        chunks = tl.where(rows_ok, tl.maximum((per_block + CHUNK - 1) // CHUNK, 1), 0)
        first = item + tl.cumsum(chunks, 0) - chunks
        for c in range(0, tl.max(chunks, 0)):
            has = c < chunks
            tl.store(WORK_SEG + first + c, bg * num_blocks + j, mask=has)
            tl.store(WORK_CHUNK + first + c, tl.zeros_like(j) + c, mask=has)
        item += tl.sum(chunks, 0)
        base += tl.sum(per_block, 0)
        below += tl.sum(counts, 0)
    if bg == num_groups - 1:
        tl.store(STARTS + num_groups * num_blocks, base)
    end = (bg + 1) * work_per_group
    for w0 in range(item, end, BLOCK_S):
        w = w0 + tl.arange(0, BLOCK_S)
        tl.store(WORK_SEG + w, tl.full([BLOCK_S], -1, tl.int32), mask=w < end)
        tl.store(WORK_CHUNK + w, tl.zeros([BLOCK_S], tl.int32), mask=w < end)


@triton.jit
def tile_scatter_kernel(BLOCKS, OFFSETS, ORDER, T, num_blocks, num_tiles, G: tl.constexpr, N: tl.constexpr,
                        N_PAD: tl.constexpr, ENTRIES: tl.constexpr, ENTRY_BITS: tl.constexpr):
    """Program (tile, b * G + g): the tile's valid slots sorted by (block, entry) in registers (one key each,
    block << ENTRY_BITS | entry; the invalid ones last), the k-th written to ORDER[OFFSETS[segment, tile] + k]."""
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    block, _, valid = _tile_slots(BLOCKS, bg // G, bg % G, tile, T, num_blocks, G, N, N_PAD, ENTRIES)
    e = tl.arange(0, ENTRIES)
    key = tl.sort(tl.where(valid, block, num_blocks) * ENTRIES + e)
    block = key >> ENTRY_BITS
    entry = key & (ENTRIES - 1)
    t = tile * (ENTRIES // N_PAD) + entry // N_PAD
    b = bg // G
    flat = ((b * T + t) * G + bg % G) * N + entry % N_PAD
    ok = block < num_blocks
    place = tl.load(OFFSETS + (bg * num_blocks + block) * num_tiles + tile, mask=ok, other=0) + e
    tl.store(ORDER + place, flat, mask=ok)
