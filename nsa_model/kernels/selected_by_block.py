"""Selected-block attention driven by key blocks (NSA_SPEC.md section 5): forward, combine, backward, dQ sum.

The query-driven kernels (selected_attention.py, selected_tiled.py) load a selected block's keys and values once
per query (or per tile of queries walking the union of their choices). With few heads per group (6 in the
125M model) that means 6 useful matrix rows per 64-key load, and the time goes to L2 traffic, not to the matrix
units. Here one program owns a slice of one key block's choosers (the inverted index: block -> the queries that
chose it, one sort outside) and loads the block's keys and values once for all of them. Its matrix rows are
(chooser, head) pairs packed without padding: row r is chooser r // HPG, head r % HPG, so 64 rows hold 10
choosers of a 6-head group (60 useful rows).

Forward: a chooser sees only part of its keys here, so the program writes a partial result per (query, slot):
the softmax-normalized output over this block's visible keys and its log2-sum-exp. `selected_combine_kernel`
then merges each query's n partials (max-shifted weights exp2(lse_i - m)) into the output and its lse. The
partials live at the query's own slot (ORDER maps a sorted entry back to its flat (b, t, g, slot) position), so
combining reads n contiguous rows and needs no second index. In nsa::core the combine also sums the gated output
of the three branches in its epilogue (GATED), so no gate pass follows it.

Backward: one fused kernel per block slice computes dK and dV (accumulated over its choosers, then added once
into float32 buffers where slices of one block meet, the last slice casting the sums; a block of one slice stores
its own) and each chooser's dQ contribution ds @ K, either stored
at the chooser's slot (DQ_MODE 1; `selected_dq_sum_kernel` adds the n slots) or added atomically into a float32
dQ (DQ_MODE 2). P and dP are computed once, where the query-driven path computes them twice (dQ kernel, dK/dV
kernel). With DQ_MODE 0 it is the dK/dV kernel of the query-driven variants (slc_dkdv = "by_block").

TMA (constexpr): the block's keys and values come in through tensor descriptors (KD, VD; range_attention.py says
why), unmasked: rows past the block or the sequence are masked out of the scores. The choosers' query rows are
a gather, which Hopper's copy engine does not do: they stay pointer loads.

PREFETCH (constexpr): each step loads the next step's chooser rows (and query tile; in the backward also do, lse and
delta) into registers before its own matrix work, and the chooser index two steps ahead, so the gather's latency
hides behind a step of work. Triton's pipeliner, given this loop, issues those loads after the step's matrix work
and waits for them at the top of the next: a gather's full latency on every step (its sm_90 code, kernels-notes
v24). 7-12% off both kernels at head dim 64 on the H100. The launchers take it up to head dim 64 only: at 128 the
backward's prefetched tiles do not fit in registers (1.43 -> 2.27 ms at paper 8k).

Masked steps: a chooser needs the causal mask only while it sits inside the block (t < the block's last key).
Every chosen block starts at or before its chooser (the selection's output; selected_attention sets other ids to
-1), and a segment's choosers come sorted by query, so those are at most the segment's first SEL_BLOCK entries.
The forward runs its steps in two loops, the first masked and the second, most of them, without the mask's
compares and selects (_masked_steps_end; kernels-notes.md v44). The backward masks every step: its unmasked loop
ran slower on the H100 although it had 15% fewer instructions a step.

Work list: programs are (segment, chunk) pairs, a segment being the choosers of one (b, g, block) and a chunk
CHUNK consecutive of them; WORK_SEG = -1 marks the spare programs of a static upper bound (no host sync).

Layouts (contiguous unless said): q [B, T, H, DK], k [B, T, G, DK] and v [B, T, G, DV] with tokens K_ROW / V_ROW
elements apart (range_attention.py), blocks [B, T, G, N_SELECT] int32 (-1 = none), ORDER [B*T*G*N_SELECT] int32
(flat slot of each sorted entry), STARTS [B*G*num_blocks + 1] int32, partial rows [B*T*G*N_SELECT*HPG, D] (row =
flat slot * HPG + head), lse/delta [B, T, H] fp32.
"""

import triton
import triton.language as tl

from nsa_model.kernels.gates import gate_rows
from nsa_model.kernels.selected_tiled import _backward_rows


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _offsets(x, OFFSETS_64: tl.constexpr):
    """x as the element offsets' integer type: int64 where some tensor's elements reach 2^31 (the launchers'
    OFFSETS_64), else int32, whose multiply-adds are one instruction each where int64's take two to four: 9% of the
    backward's sm_90 instructions, 2% of the forward's (kernels-notes.md v42)."""
    if OFFSETS_64:
        return x.to(tl.int64)
    else:
        return x


@triton.jit
def _work_item(WORK_SEG, WORK_CHUNK, STARTS, num_blocks, G: tl.constexpr, CHUNK: tl.constexpr):
    """(segment, b, g, block j, the segment's first entry, this program's first entry, its end entry) of this
    program; segment -1: nothing to do."""
    pid = tl.program_id(0)
    seg = tl.load(WORK_SEG + pid)
    seg_c = tl.maximum(seg, 0)
    chunk = tl.load(WORK_CHUNK + pid)
    first = tl.load(STARTS + seg_c)
    start = first + chunk * CHUNK
    end = tl.minimum(tl.load(STARTS + seg_c + 1), start + CHUNK)
    j = seg_c % num_blocks
    bg = seg_c // num_blocks
    return seg, bg // G, bg % G, j, first, start, end


@triton.jit
def _masked_steps_end(first, start, end, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, ENTRIES: tl.constexpr):
    """Where this program's steps that need the visibility mask end: steps from start to the result run with it,
    the rest without (two loops, so no step branches; a branch inside the backward's loop cost 6-12%,
    kernels-notes.md v24). A segment's choosers come sorted by query, and a query chooses no block after its own,
    so only the block's own queries, at most SEL_BLOCK and the segment's first entries, can miss some of its keys:
    every later chooser's t is past the block's last key (which is then inside the sequence too). The result is
    start plus whole steps (the prefetch's order), or end. A block narrower than its tile masks every step (the
    tile's padded keys)."""
    split = tl.minimum(start + tl.cdiv(tl.maximum(first + SEL_BLOCK - start, 0), ENTRIES) * ENTRIES, end)
    if SEL_BLOCK != BLOCK_S:
        split = end
    return split


@triton.jit
def _block_kv(K, V, KD, VD, K_ROW, V_ROW, b, g, j, T, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
              TMA: tl.constexpr, OFFSETS_64: tl.constexpr):
    offs_s = tl.arange(0, BLOCK_S)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    pos = j * SEL_BLOCK + offs_s
    s_ok = (offs_s < SEL_BLOCK) & (pos < T)
    tok = _offsets(b * T + pos, OFFSETS_64)
    row_k = tok * G + g  # the gradients' rows: dK and dV are contiguous
    if TMA:
        k = KD.load([b * T + j * SEL_BLOCK, g * DK])
        v = VD.load([b * T + j * SEL_BLOCK, g * DV])
    else:
        k = tl.load(K + tok[:, None] * K_ROW + g * DK + offs_dk[None, :],
                    mask=s_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
        v = tl.load(V + tok[:, None] * V_ROW + g * DV + offs_dv[None, :],
                    mask=s_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    return k, v, pos, s_ok, row_k


@triton.jit
def _chooser_flat(ORDER, e0, end, HPG: tl.constexpr, ROWS: tl.constexpr):
    """(flat slot, row ok) of rows (chooser e0 + r // HPG, head r % HPG): ((b * T + t) * G + g) * N_SELECT + i."""
    ENTRIES: tl.constexpr = ROWS // HPG
    slot = tl.arange(0, ROWS) // HPG
    entry = e0 + slot
    r_ok = (slot < ENTRIES) & (entry < end)
    return tl.load(ORDER + entry, mask=r_ok, other=0), r_ok


@triton.jit
def _chooser_decode(flat, b, g, T, H: tl.constexpr, G: tl.constexpr, N_SELECT: tl.constexpr, ROWS: tl.constexpr,
                    OFFSETS_64: tl.constexpr):
    """(query t, row in [B*T*H], row in the partials) of _chooser_flat's rows.

    Index arithmetic stays in int32 (ORDER is int32, so flat slots fit) with constexpr divisors, which compile to
    multiply-shifts: a 64-bit division per row costs about as much as a step's matrix work."""
    HPG: tl.constexpr = H // G
    head = tl.arange(0, ROWS) % HPG
    bt = flat // (G * N_SELECT)
    t = bt - b * T
    row_q = _offsets(bt, OFFSETS_64) * H + (g * HPG + head)
    row_p = _offsets(flat, OFFSETS_64) * HPG + head
    return t, row_q, row_p


@triton.jit
def _visible(t, r_ok, pos, s_ok, SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr):
    """[rows, keys] mask of the keys each chooser row sees. With the block as wide as the tile, pos <= t alone does:
    t < T keeps out keys past the sequence, and rows past the chooser list are zero rows (q, do, lse and delta
    loaded as 0) whose results are not stored and which add nothing to dK and dV."""
    if SEL_BLOCK == BLOCK_S:
        return pos[None, :] <= t[:, None]
    return r_ok[:, None] & s_ok[None, :] & (pos[None, :] <= t[:, None])


@triton.jit
def _chooser_fwd_tiles(Q, flat, r_ok, b, g, T, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                       BLOCK_DK: tl.constexpr, N_SELECT: tl.constexpr, ROWS: tl.constexpr, OFFSETS_64: tl.constexpr):
    """(t, row_q, row_p, q) of the forward's rows (_chooser_flat's): the query tile is a gather of their rows."""
    t, row_q, row_p = _chooser_decode(flat, b, g, T, H, G, N_SELECT, ROWS, OFFSETS_64)
    offs_dk = tl.arange(0, BLOCK_DK)
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=r_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    return t, row_q, row_p, q


@triton.jit
def _chooser_bwd_tiles(Q, DO, LSE, DELTA, flat, r_ok, b, g, T, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, N_SELECT: tl.constexpr,
                       ROWS: tl.constexpr, OFFSETS_64: tl.constexpr):
    """(t, row_q, row_p, q, do, lse2, delta) of the backward's rows (_chooser_flat's)."""
    t, row_q, row_p = _chooser_decode(flat, b, g, T, H, G, N_SELECT, ROWS, OFFSETS_64)
    q, do, lse2, delta = _backward_rows(Q, DO, LSE, DELTA, row_q, r_ok, DK, DV, BLOCK_DK, BLOCK_DV)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # a query that sees no key: its p is masked anyway
    return t, row_q, row_p, q, do, lse2, delta


@triton.jit
def selected_block_fwd_kernel(Q, K, V, KD, VD, ORDER, STARTS, WORK_SEG, WORK_CHUNK, O_PART, LSE2_PART, T, num_blocks,
                              scale, K_ROW, V_ROW,
                              H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                              BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, ROWS: tl.constexpr,
                              CHUNK: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                              OFFSETS_64: tl.constexpr, PREFETCH: tl.constexpr = False):
    HPG: tl.constexpr = H // G
    ENTRIES: tl.constexpr = ROWS // HPG
    seg, b, g, j, first, start, end = _work_item(WORK_SEG, WORK_CHUNK, STARTS, num_blocks, G, CHUNK)
    if seg >= 0:
        k, v, pos, s_ok, _ = _block_kv(K, V, KD, VD, K_ROW, V_ROW, b, g, j, T, G, DK, DV, BLOCK_DK, BLOCK_DV,
                                       SEL_BLOCK, BLOCK_S, TMA, OFFSETS_64)
        offs_dv = tl.arange(0, BLOCK_DV)
        qk_scale = scale * LOG2E
        split = _masked_steps_end(first, start, end, SEL_BLOCK, BLOCK_S, ENTRIES)
        for PHASE in tl.static_range(2):  # 0: the block's own queries' steps, masked; 1: the rest, unmasked
            lo = start if PHASE == 0 else split
            hi = split if PHASE == 0 else end
            if PREFETCH:  # step e0's rows and query tile come from the step before (module docstring). Loaded
                # again for each loop (carried from the first, they reached the second in one layout and were
                # converted there through shared memory on every step), and each loop's loads stop at its own end:
                # a program with no masked step loads nothing for the first loop, and the first loop's last step
                # loads nothing for the second
                flat, r_ok = _chooser_flat(ORDER, lo, hi, HPG, ROWS)
                t, row_q, row_p, q = _chooser_fwd_tiles(Q, flat, r_ok, b, g, T, H, G, DK, BLOCK_DK, N_SELECT, ROWS,
                                                        OFFSETS_64)
                flat_n, r_ok_n = _chooser_flat(ORDER, lo + ENTRIES, hi, HPG, ROWS)
            for e0 in tl.range(lo, hi, ENTRIES, num_stages=1 if PREFETCH else None):
                if PREFETCH:
                    flat_nn, r_ok_nn = _chooser_flat(ORDER, e0 + 2 * ENTRIES, hi, HPG, ROWS)
                    t_n, row_q_n, row_p_n, q_n = _chooser_fwd_tiles(Q, flat_n, r_ok_n, b, g, T, H, G, DK, BLOCK_DK,
                                                                    N_SELECT, ROWS, OFFSETS_64)
                else:
                    flat, r_ok = _chooser_flat(ORDER, e0, hi, HPG, ROWS)
                    t, row_q, row_p, q = _chooser_fwd_tiles(Q, flat, r_ok, b, g, T, H, G, DK, BLOCK_DK, N_SELECT,
                                                            ROWS, OFFSETS_64)
                # the scale goes into the exponential's argument, one FMA an element instead of a multiply and a
                # subtraction (kernels-notes.md v42)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                if PHASE == 0:
                    s = tl.where(_visible(t, r_ok, pos, s_ok, SEL_BLOCK, BLOCK_S), s, float("-inf"))
                    m = tl.max(s, axis=1) * qk_scale
                    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row that sees none of the block
                else:  # every row sees every key (rows past the list are zeros, not stored)
                    m_safe = tl.max(s, axis=1) * qk_scale
                p = tl.exp2(s * qk_scale - m_safe[:, None])
                l_i = tl.sum(p, axis=1)
                acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                if PHASE == 0:
                    has_key = l_i > 0
                    l_safe = tl.where(has_key, l_i, 1.0)
                    lse2 = tl.where(has_key, m_safe + tl.log2(l_safe), float("-inf"))
                else:  # the row's maximum gives p = 1: l_i >= 1
                    l_safe = l_i
                    lse2 = m_safe + tl.log2(l_i)
                # one reciprocal a row and a multiply an element: a division an element is a MUFU op and a multiply
                # each, 32 a thread a step beside the step's 32 exponentials (kernels-notes.md v41). The partials
                # pass through L2 once, on their way to the combine: evict_first leaves L2 to the gathered query
                # rows (v43)
                tl.store(O_PART + row_p[:, None] * DV + offs_dv[None, :],
                         (acc * (1.0 / l_safe)[:, None]).to(O_PART.dtype.element_ty),
                         mask=r_ok[:, None] & (offs_dv < DV)[None, :], eviction_policy="evict_first")
                tl.store(LSE2_PART + row_p, lse2, mask=r_ok, eviction_policy="evict_first")
                if PREFETCH:
                    r_ok, t, row_q, row_p, q = r_ok_n, t_n, row_q_n, row_p_n, q_n
                    flat_n, r_ok_n = flat_nn, r_ok_nn


@triton.jit
def combine_slots(O_PART, LSE2_PART, BLOCKS, rows, r_ok, H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
                  BLOCK_DV: tl.constexpr, N_SELECT: tl.constexpr, BLOCK_R: tl.constexpr):
    """(o [BLOCK_R, BLOCK_DV] fp32, lse [BLOCK_R] natural log) of rows (b * T + t) * H + hh (int64 [BLOCK_R]) from
    their n partials; slots with block -1 hold nothing and are skipped."""
    HPG: tl.constexpr = H // G
    offs_dv = tl.arange(0, BLOCK_DV)
    bt = rows // H
    hh = rows % H
    slot0 = (bt * G + hh // HPG) * N_SELECT
    head = hh % HPG
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i in range(N_SELECT):
        used = r_ok & (tl.load(BLOCKS + slot0 + i, mask=r_ok, other=-1) >= 0)
        m = tl.maximum(m, tl.load(LSE2_PART + (slot0 + i) * HPG + head, mask=used, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for i in range(N_SELECT):
        used = r_ok & (tl.load(BLOCKS + slot0 + i, mask=r_ok, other=-1) >= 0)
        row_p = (slot0 + i) * HPG + head
        w = tl.exp2(tl.load(LSE2_PART + row_p, mask=used, other=float("-inf")) - m_safe)
        part = tl.load(O_PART + row_p[:, None] * DV + offs_dv[None, :], mask=used[:, None] & (offs_dv < DV)[None, :],
                       other=0.0)
        acc += w[:, None] * part.to(tl.float32)
        l_i += w
    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(has_key, (m_safe + tl.log2(l_safe)) / LOG2E, float("-inf"))


@triton.jit
def selected_combine_kernel(O_PART, LSE2_PART, BLOCKS, O, LSE, num_rows, H: tl.constexpr, G: tl.constexpr,
                            DV: tl.constexpr, BLOCK_DV: tl.constexpr, N_SELECT: tl.constexpr, BLOCK_R: tl.constexpr,
                            GATES=None, O_CMP=None, O_WIN=None, O_GATED=None, GATED: tl.constexpr = False):
    """o[b, t, h] and lse from the n partials of (b, t, h) (combine_slots). GATED (nsa::core): also the gated output
    O_GATED = g_cmp O_CMP + g_slc O + g_win O_WIN from the stored values of the three ([ROWS, 3] GATES; gates.py),
    the gate pass's work in this one's epilogue, where o is still in registers (kernels-notes.md v40)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (b * T + t) * H + hh
    offs_dv = tl.arange(0, BLOCK_DV)
    r_ok = rows < num_rows
    o, lse = combine_slots(O_PART, LSE2_PART, BLOCKS, rows, r_ok, H, G, DV, BLOCK_DV, N_SELECT, BLOCK_R)
    o = o.to(O.dtype.element_ty)
    at = rows[:, None] * DV + offs_dv[None, :]
    ok = r_ok[:, None] & (offs_dv < DV)[None, :]
    if GATED:  # o and lse wait for the backward, and o_cmp and o_win are read here for the last time in the forward
        tl.store(O + at, o, mask=ok, eviction_policy="evict_first")
        tl.store(LSE + rows, lse, mask=r_ok, eviction_policy="evict_first")
        o_cmp = tl.load(O_CMP + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o_win = tl.load(O_WIN + at, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
        gated = gate_rows(GATES, rows, r_ok, o_cmp, o.to(tl.float32), o_win)
        tl.store(O_GATED + at, gated.to(O_GATED.dtype.element_ty), mask=ok)
    else:
        tl.store(O + at, o, mask=ok)
        tl.store(LSE + rows, lse, mask=r_ok)


@triton.jit
def selected_block_bwd_kernel(Q, K, V, KD, VD, DO, LSE, DELTA, ORDER, STARTS, WORK_SEG, WORK_CHUNK, DK_ACC, DV_ACC,
                              DQ_OUT, DK_OUT, DV_OUT, DONE, T, num_blocks, scale, K_ROW, V_ROW,
                              H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
                              BLOCK_S: tl.constexpr, N_SELECT: tl.constexpr, ROWS: tl.constexpr,
                              CHUNK: tl.constexpr, DQ_MODE: tl.constexpr,
                              TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, OFFSETS_64: tl.constexpr,
                              PREFETCH: tl.constexpr = False):
    """DQ_MODE: 0 no dQ (the query-driven variants compute it), 1 store each chooser's contribution at its slot
    (DQ_OUT rows as the partials), 2 add it atomically into a float32 DQ_OUT [B, T, H, DK], 3 store each chooser's
    ds (scale included, rounded as dK's product takes it) at its slot, DQ_OUT rows of BLOCK_S columns, for the
    query-driven dQ to multiply by the keys (selected_tiled_dq_from_ds_kernel, selected_dq_from_ds_kernel): dQ
    with one product a block instead of three, and only for the queries that chose it.

    The block's dK, dV end in DK_OUT, DV_OUT (their dtype), with no cast launch after (0.4 ms per training step
    at T = 2048, kernels-notes.md v20). The work list has an item for every segment, so every key row is written
    (an unchosen block's with zeros). A segment of one chunk stores its block directly; in a longer one each
    program adds into the float32 accumulators DK_ACC, DV_ACC and counts itself done (DONE [segments] int32,
    zeroed), and the last one casts the sums."""
    HPG: tl.constexpr = H // G
    ENTRIES: tl.constexpr = ROWS // HPG
    seg, b, g, j, _, start, end = _work_item(WORK_SEG, WORK_CHUNK, STARTS, num_blocks, G, CHUNK)
    if seg >= 0:
        k, v, pos, s_ok, row_k = _block_kv(K, V, KD, VD, K_ROW, V_ROW, b, g, j, T, G, DK, DV, BLOCK_DK, BLOCK_DV,
                                           SEL_BLOCK, BLOCK_S, TMA, OFFSETS_64)
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        qk_scale = scale * LOG2E
        log2_scale = tl.log2(scale)
        dk = tl.zeros([BLOCK_S, BLOCK_DK], tl.float32)
        dv = tl.zeros([BLOCK_S, BLOCK_DV], tl.float32)
        if PREFETCH:  # as in the forward
            flat, r_ok = _chooser_flat(ORDER, start, end, HPG, ROWS)
            t, row_q, row_p, q, do, lse2, delta = _chooser_bwd_tiles(Q, DO, LSE, DELTA, flat, r_ok, b, g, T, H, G,
                                                                     DK, DV, BLOCK_DK, BLOCK_DV, N_SELECT, ROWS,
                                                                     OFFSETS_64)
            flat_n, r_ok_n = _chooser_flat(ORDER, start + ENTRIES, end, HPG, ROWS)
        for e0 in tl.range(start, end, ENTRIES, num_stages=1 if PREFETCH else None):
            if PREFETCH:
                flat_nn, r_ok_nn = _chooser_flat(ORDER, e0 + 2 * ENTRIES, end, HPG, ROWS)
                t_n, row_q_n, row_p_n, q_n, do_n, lse2_n, delta_n = _chooser_bwd_tiles(
                    Q, DO, LSE, DELTA, flat_n, r_ok_n, b, g, T, H, G, DK, DV, BLOCK_DK, BLOCK_DV, N_SELECT, ROWS,
                    OFFSETS_64)
            else:
                flat, r_ok = _chooser_flat(ORDER, e0, end, HPG, ROWS)
                t, row_q, row_p, q, do, lse2, delta = _chooser_bwd_tiles(Q, DO, LSE, DELTA, flat, r_ok, b, g, T, H,
                                                                         G, DK, DV, BLOCK_DK, BLOCK_DV, N_SELECT,
                                                                         ROWS, OFFSETS_64)
            q_ok = r_ok[:, None] & (offs_dk < DK)[None, :]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            # Every step masked: a second, unmasked loop like the forward's made this kernel 5-7% slower on the H100
            # with 15% fewer instructions a step (it is bound by its waits, v44), and a branch around the mask 6-12%
            # slower (v24).
            # p and ds carry the softmax scale (p * scale = exp2(s - (lse2 - log2 scale))): dK and dQ take ds * scale
            # with no multiply an element, and dV divides it out once at the end (kernels-notes.md v42)
            p = tl.where(_visible(t, r_ok, pos, s_ok, SEL_BLOCK, BLOCK_S),
                         tl.exp2(s - (lse2 - log2_scale)[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = (p * (dp - delta[:, None])).to(q.dtype)  # rounded once for dK and dQ
            dk += tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)
            if DQ_MODE == 1:
                dq = tl.dot(ds, k, input_precision=DOT_PRECISION)
                tl.store(DQ_OUT + row_p[:, None] * DK + offs_dk[None, :], dq.to(DQ_OUT.dtype.element_ty), mask=q_ok,
                         eviction_policy="evict_first")  # as the forward's partials (v43)
            elif DQ_MODE == 2:
                dq = tl.dot(ds, k, input_precision=DOT_PRECISION)
                tl.atomic_add(DQ_OUT + row_q[:, None] * DK + offs_dk[None, :], dq, mask=q_ok, sem="relaxed")
            elif DQ_MODE == 3:  # ds itself, zero where not visible; the query-driven dQ kernels read it
                offs_s = tl.arange(0, BLOCK_S)
                tl.store(DQ_OUT + row_p[:, None] * BLOCK_S + offs_s[None, :], ds, mask=r_ok[:, None],
                         eviction_policy="evict_first")
            if PREFETCH:
                r_ok, t, row_q, row_p, q, do, lse2, delta = r_ok_n, t_n, row_q_n, row_p_n, q_n, do_n, lse2_n, delta_n
                flat_n, r_ok_n = flat_nn, r_ok_nn
        dv = dv * (1.0 / scale)
        k_rows = row_k[:, None] * DK + offs_dk[None, :]
        v_rows = row_k[:, None] * DV + offs_dv[None, :]
        k_ok = s_ok[:, None] & (offs_dk < DK)[None, :]
        v_ok = s_ok[:, None] & (offs_dv < DV)[None, :]
        count = tl.load(STARTS + seg + 1) - tl.load(STARTS + seg)
        if count <= CHUNK:  # the segment's only program
            tl.store(DK_OUT + k_rows, dk.to(DK_OUT.dtype.element_ty), mask=k_ok)
            tl.store(DV_OUT + v_rows, dv.to(DV_OUT.dtype.element_ty), mask=v_ok)
        else:
            # The adds are relaxed (tl.atomic_add's default, acq_rel, fences each one: v51): the barrier
            # orders every thread's adds before the count's release, which makes them visible to the program
            # that acquires the last count (the split-K semaphore pattern)
            tl.atomic_add(DK_ACC + k_rows, dk, mask=k_ok, sem="relaxed")
            tl.atomic_add(DV_ACC + v_rows, dv, mask=v_ok, sem="relaxed")
            tl.debug_barrier()  # every thread's adds are issued before the count says this program is done
            done = tl.atomic_add(DONE + seg, 1, sem="acq_rel")
            if done == (count + CHUNK - 1) // CHUNK - 1:  # the last: the others' adds are visible to it
                dk = tl.load(DK_ACC + k_rows, mask=k_ok, other=0.0, volatile=True)
                dv = tl.load(DV_ACC + v_rows, mask=v_ok, other=0.0, volatile=True)
                tl.store(DK_OUT + k_rows, dk.to(DK_OUT.dtype.element_ty), mask=k_ok)
                tl.store(DV_OUT + v_rows, dv.to(DV_OUT.dtype.element_ty), mask=v_ok)


@triton.jit
def selected_dq_sum_kernel(DQ_PART, BLOCKS, DQ, ADD_A, ADD_B, num_rows, H: tl.constexpr, G: tl.constexpr,
                           DK: tl.constexpr, BLOCK_DK: tl.constexpr, N_SELECT: tl.constexpr, BLOCK_R: tl.constexpr,
                           NUM_ADD: tl.constexpr):
    """dq[b, t, h] = the sum of its n slots' contributions (slots with block -1 hold nothing), plus the first NUM_ADD
    (0, 1 or 2) of add_a, add_b ([B, T, H, DK] like dq: the other branches' dQ, apart or already summed by the
    range kernels' two-range dQ; added here in fp32 instead of in passes of their own)."""
    HPG: tl.constexpr = H // G
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DK)
    r_ok = rows < num_rows
    bt = rows // H
    hh = rows % H
    slot0 = (bt * G + hh // HPG) * N_SELECT
    head = hh % HPG
    acc = tl.zeros([BLOCK_R, BLOCK_DK], tl.float32)
    for i in range(N_SELECT):
        used = r_ok & (tl.load(BLOCKS + slot0 + i, mask=r_ok, other=-1) >= 0)
        row_p = (slot0 + i) * HPG + head
        acc += tl.load(DQ_PART + row_p[:, None] * DK + offs_dk[None, :], mask=used[:, None] & (offs_dk < DK)[None, :],
                       other=0.0).to(tl.float32)
    at = rows[:, None] * DK + offs_dk[None, :]
    ok = r_ok[:, None] & (offs_dk < DK)[None, :]
    if NUM_ADD >= 1:
        acc += tl.load(ADD_A + at, mask=ok, other=0.0).to(tl.float32)
    if NUM_ADD >= 2:
        acc += tl.load(ADD_B + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DQ + at, acc.to(DQ.dtype.element_ty), mask=ok)
