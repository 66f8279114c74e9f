"""RoPE over the rows of the attention's projections, writing each part of the fused q/k/v projection into its
own tensor (forward), or each part's gradient into its columns of the projection's gradient (backward).

A row is one (b, t, head): D values, rotated in pairs (i, i + D/2) by the angles of position t (Llama's
rotate-half convention, nsa_model/rope.py) or copied as they are (the V parts). INVERSE turns by minus the
angle (the backward of a rotation) and runs the other way, from the parts into Y. Each program handles BLOCK_T
tokens of every part, so one launch does the whole split (a launch per part cost NSA's 8 parts 0.25 ms more per
training step at T = 2048; the op is bandwidth-bound, kernels-notes.md v19). Every value is read and written
once, in place of a concatenation's masked kernel and its float32 buffers (v18).

Layouts: Y [B, T, width] with its rows y_sb, y_st elements apart and its columns contiguous; part i
[B, T, HEADS[i], DIMS[i]] at b * sb[i] + t * st[i] + h * sh[i] elements (the last dimension contiguous), columns
COLS[i] .. of Y; COS, SIN [T, D/2] float32, contiguous (D: the rotated parts' head dim).

AT_POS (a decoding step, forward only): token t of Y is position p + t, p read from POS (an int64 on the device,
so that one CUDA graph serves every step): its angles are row p + t of COS, SIN (the whole tables), and the parts
with TO_POS[i] are a decoding cache's buffers [B, L, HEADS[i], DIMS[i]], written at row p + t: the step's keys and
values go straight into the cache, with no copy after (v69).
"""

import triton
import triton.language as tl


@triton.jit
def _rope_part(Y, PART, COS, SIN, tok0, num_tokens, T, pos0, y_sb, y_st, p_sb, p_st, p_sh, COL: tl.constexpr,
               HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               ROTATE: tl.constexpr, INVERSE: tl.constexpr, TO_POS: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.arange(0, BLOCK_T * HEADS_PAD)
    tok = tok0 + rows // HEADS_PAD  # power-of-two divisor: a shift
    h = rows % HEADS_PAD
    r_ok = (tok < num_tokens) & (h < HEADS)
    t = tok % T
    b = (tok // T).to(tl.int64)
    y_row = b * y_sb + t.to(tl.int64) * y_st + COL + h * D
    p_t = t + pos0 if TO_POS else t  # pos0 is 0 unless AT_POS
    p_row = b * p_sb + p_t.to(tl.int64) * p_st + h.to(tl.int64) * p_sh
    if INVERSE:  # the backward: the part's gradient into Y's columns
        src, dst, OUT = PART + p_row, Y + y_row, Y
    else:
        src, dst, OUT = Y + y_row, PART + p_row, PART
    if ROTATE:
        HALF: tl.constexpr = D // 2
        offs = tl.arange(0, BLOCK_D // 2)
        ok = r_ok[:, None] & (offs < HALF)[None, :]
        x1 = tl.load(src[:, None] + offs[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src[:, None] + HALF + offs[None, :], mask=ok, other=0.0).to(tl.float32)
        angle = (t + pos0)[:, None] * HALF + offs[None, :]
        c = tl.load(COS + angle, mask=ok, other=0.0)
        s = tl.load(SIN + angle, mask=ok, other=0.0)
        if INVERSE:
            s = -s
        tl.store(dst[:, None] + offs[None, :], (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=ok)
        tl.store(dst[:, None] + HALF + offs[None, :], (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=ok)
    else:
        offs = tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (offs < D)[None, :]
        x = tl.load(src[:, None] + offs[None, :], mask=ok, other=0.0)
        tl.store(dst[:, None] + offs[None, :], x.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def rope_split_kernel(Y, PARTS, COS, SIN, POS, num_tokens, T, y_sb, y_st, part_sb, part_st, part_sh,
                      COLS: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIMS: tl.constexpr,
                      BLOCK_DIMS: tl.constexpr, ROTATE: tl.constexpr, INVERSE: tl.constexpr, AT_POS: tl.constexpr,
                      TO_POS: tl.constexpr, BLOCK_T: tl.constexpr):
    tok0 = tl.program_id(0) * BLOCK_T
    pos0 = tl.load(POS).to(tl.int32) if AT_POS else 0
    for i in tl.static_range(len(HEADS)):
        _rope_part(Y, PARTS[i], COS, SIN, tok0, num_tokens, T, pos0, y_sb, y_st, part_sb[i], part_st[i],
                   part_sh[i], COLS[i], HEADS[i], HEADS_PAD[i], DIMS[i], BLOCK_DIMS[i], ROTATE[i], INVERSE,
                   TO_POS[i], BLOCK_T)
