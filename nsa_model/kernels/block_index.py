"""The selected branch's indexes, built from the selections blocks [B, T, G, n] (int32, -1 for an empty slot).

Each was a chain of PyTorch ops: about 35 small launches per layer call in the forward, about 2.4 ms per
training step of nsa-125m at T = 2048 besides the sort (kernels-notes.md, v19). by_block's inverted index was then
a stable radix sort of segment keys (five launches of torch.sort, 57 us of the 72 us index at 125M 4 x 8k on the
H200; v32); it is a counting sort now, in four launches, each entry's segment s = (b * G + g) * num_blocks +
block its bucket (num_blocks: an empty slot), the queries cut into chunks of QC:

  chunk_counts_kernel    each chunk's bucket sizes, and where each bucket starts inside the chunk's sorted run
  chunk_offsets_kernel   per bucket, the entries in earlier chunks (a scan across chunks) and the bucket's size
  segment_layout_kernel  one program: each segment's first entry (starts), where each (b, g)'s empty slots go,
                         and the work list: program p of the by_block kernels takes chunk work_chunk[p] of segment
                         work_seg[p] (-1: nothing)
  scatter_order_kernel   each chunk sorted in registers by (bucket, entry), every entry stored at its position
  segment_ids_kernel     each slot's segment, the key of the stable sort of the inverted index that the query-driven
                         variants' dK/dV kernel reads (slc_dkdv = "inverted")
  tile_union_kernel      for each tile of TILE_Q consecutive queries, the distinct blocks they chose, ascending,
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
def _chunk_entries(BLOCKS, c, b, g, T, num_blocks, G: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr,
                   QC: tl.constexpr):
    """(e, ok, bucket) of chunk c's QC queries of (b, g): entry e = local query * N_PAD + slot; bucket = the block,
    num_blocks for an empty slot; ok is False on padding (past T or past N)."""
    e = tl.arange(0, QC * N_PAD)
    t = c * QC + e // N_PAD
    i = e % N_PAD
    ok = (t < T) & (i < N)
    block = tl.load(BLOCKS + ((b * T + t).to(tl.int64) * G + g) * N + i, mask=ok, other=-1)
    return e, ok, tl.where(block >= 0, block, num_blocks)


@triton.jit
def chunk_counts_kernel(BLOCKS, COUNTS, EXCL, T, num_blocks, num_chunks, G: tl.constexpr, N: tl.constexpr,
                        N_PAD: tl.constexpr, QC: tl.constexpr, NBE_PAD: tl.constexpr):
    """Program (chunk c, b * G + g): how many of the chunk's entries fall in each bucket k (num_blocks + 1 of them,
    the last for empty slots), stored at COUNTS[bg, k, c] for the scan across chunks, and the count of the chunk's
    entries in buckets before k at EXCL[bg, c, k] (where bucket k starts inside the chunk's own sorted run)."""
    c = tl.program_id(0)
    bg = tl.program_id(1)
    _, ok, bucket = _chunk_entries(BLOCKS, c, bg // G, bg % G, T, num_blocks, G, N, N_PAD, QC)
    count = tl.histogram(bucket, NBE_PAD, mask=ok)
    k = tl.arange(0, NBE_PAD)
    k_ok = k <= num_blocks
    row = bg.to(tl.int64) * (num_blocks + 1)
    tl.store(COUNTS + (row + k) * num_chunks + c, count, mask=k_ok)
    tl.store(EXCL + (bg.to(tl.int64) * num_chunks + c) * (num_blocks + 1) + k, tl.cumsum(count, 0) - count,
             mask=k_ok)


@triton.jit
def chunk_offsets_kernel(COUNTS, TOTALS, num_buckets, num_chunks, BLOCK_K: tl.constexpr, C_PAD: tl.constexpr):
    """Program (bucket tile, bg): COUNTS[bg, k, :] replaced by its exclusive prefix sum over the chunks (the entries
    of bucket k in earlier chunks), and TOTALS[bg, k] = the bucket's size."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    c = tl.arange(0, C_PAD)
    ok = (k < num_buckets)[:, None] & (c < num_chunks)[None, :]
    at = (tl.program_id(1).to(tl.int64) * num_buckets + k)[:, None] * num_chunks + c[None, :]
    count = tl.load(COUNTS + at, mask=ok, other=0)
    tl.store(COUNTS + at, tl.cumsum(count, 1) - count, mask=ok)
    tl.store(TOTALS + tl.program_id(1).to(tl.int64) * num_buckets + k, tl.sum(count, 1), mask=k < num_buckets)


@triton.jit
def segment_layout_kernel(TOTALS, STARTS, EMPTY_BASE, WORK_SEG, WORK_CHUNK, num_blocks, num_groups, num_work,
                          CHUNK: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program, from the bucket sizes: STARTS[s] of each segment s = bg * num_blocks + j (bucket j of bg) and
    STARTS[S] = every valid entry; EMPTY_BASE[bg], where bg's empty slots go (after every segment, bg after bg);
    and the work list: segment s's cdiv(count, CHUNK) chunks, at least one (an empty segment's item writes its
    block's zero gradient), are consecutive items, segment after segment; the spare items get segment -1."""
    num_segments = num_groups * num_blocks
    entries = 0
    items = 0
    for s0 in range(0, num_segments, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < num_segments
        count = tl.load(TOTALS + (s // num_blocks) * (num_blocks + 1) + s % num_blocks, mask=ok, other=0)
        tl.store(STARTS + s, entries + tl.cumsum(count, 0) - count, mask=ok)
        entries += tl.sum(count, 0)
        chunks = tl.where(ok, tl.maximum((count + CHUNK - 1) // CHUNK, 1), 0)
        item = items + tl.cumsum(chunks, 0) - chunks  # the segment's first work item
        for c in range(0, tl.max(chunks, 0)):
            has = c < chunks
            tl.store(WORK_SEG + item + c, s, mask=has)
            tl.store(WORK_CHUNK + item + c, tl.zeros_like(s) + c, mask=has)
        items += tl.sum(chunks, 0)
    tl.store(STARTS + num_segments, entries)
    for g0 in range(0, num_groups, BLOCK_S):
        bg = g0 + tl.arange(0, BLOCK_S)
        ok = bg < num_groups
        count = tl.load(TOTALS + bg * (num_blocks + 1) + num_blocks, mask=ok, other=0)
        tl.store(EMPTY_BASE + bg, entries + tl.cumsum(count, 0) - count, mask=ok)
        entries += tl.sum(count, 0)
    for w0 in range(items, num_work, BLOCK_S):
        w = w0 + tl.arange(0, BLOCK_S)
        tl.store(WORK_SEG + w, tl.full([BLOCK_S], -1, tl.int32), mask=w < num_work)
        tl.store(WORK_CHUNK + w, tl.zeros([BLOCK_S], tl.int32), mask=w < num_work)


@triton.jit
def scatter_order_kernel(BLOCKS, EXCL, OFFSETS, STARTS, EMPTY_BASE, ORDER, T, num_blocks, num_chunks,
                         G: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, QC: tl.constexpr):
    """Program (chunk c, bg): sorts the chunk's entries by (bucket, entry) in registers, which puts each bucket's
    entries in query order at ranks 0, 1, .. from EXCL[bg, c, bucket], and stores each entry's flat slot at
    its bucket's start + OFFSETS[bg, bucket, c] (earlier chunks' entries) + that rank. Padding sorts last."""
    c = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // G
    g = bg % G
    E: tl.constexpr = QC * N_PAD
    e, ok, bucket = _chunk_entries(BLOCKS, c, b, g, T, num_blocks, G, N, N_PAD, QC)
    key = tl.sort(tl.where(ok, bucket, num_blocks + 1) * E + e)
    bucket = key // E
    e = key % E
    real = bucket <= num_blocks
    bucket = tl.minimum(bucket, num_blocks)
    row = bg.to(tl.int64) * (num_blocks + 1) + bucket
    rank = tl.arange(0, E) - tl.load(EXCL + (bg.to(tl.int64) * num_chunks + c) * (num_blocks + 1) + bucket,
                                     mask=real, other=0)
    first = tl.where(bucket < num_blocks, tl.load(STARTS + bg * num_blocks + bucket, mask=real, other=0),
                     tl.load(EMPTY_BASE + bg + bucket * 0, mask=real, other=0))
    pos = first + tl.load(OFFSETS + row * num_chunks + c, mask=real, other=0) + rank
    flat = ((b * T + c * QC + e // N_PAD).to(tl.int64) * G + g) * N + e % N_PAD
    tl.store(ORDER + pos, flat.to(tl.int32), mask=real)


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
