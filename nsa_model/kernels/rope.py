"""RoPE over the rows of the attention's projections, writing each part of the fused q/k/v projection into its
own tensor (forward), or each part's gradient into its columns of the projection's gradient (backward).

A row is one (b, t, head): D values, rotated in pairs (i, i + D/2) by the angles of position t (Llama's
rotate-half convention, nsa_model/rope.py) or copied as they are (the V parts). INVERSE turns by minus the
angle: the backward of a rotation. Each program handles BLOCK_R rows of one part; every value is read and written
once, in place of a concatenation's masked kernel and its float32 buffers (kernels-notes.md, v18).

Layouts: X and OUT rows at b * s_b + t * s_t + h * s_h elements (the last dimension contiguous); COS, SIN
[T, D/2] float32, contiguous.
"""

import triton
import triton.language as tl


@triton.jit
def rope_rows_kernel(X, OUT, COS, SIN, num_rows, T, x_sb, x_st, x_sh, o_sb, o_st, o_sh,
                     HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
                     INVERSE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < num_rows
    h = rows % HEADS  # constexpr divisor: a multiply-shift
    bt = rows // HEADS
    t = bt % T
    b = bt // T
    x_row = b.to(tl.int64) * x_sb + t.to(tl.int64) * x_st + h.to(tl.int64) * x_sh
    o_row = b.to(tl.int64) * o_sb + t.to(tl.int64) * o_st + h.to(tl.int64) * o_sh
    if ROTATE:
        HALF: tl.constexpr = D // 2
        offs = tl.arange(0, BLOCK_D // 2)
        ok = r_ok[:, None] & (offs < HALF)[None, :]
        x1 = tl.load(X + x_row[:, None] + offs[None, :], mask=ok, other=0.0)
        x2 = tl.load(X + x_row[:, None] + HALF + offs[None, :], mask=ok, other=0.0)
        angle = t[:, None] * HALF + offs[None, :]
        c = tl.load(COS + angle, mask=ok, other=0.0)
        s = tl.load(SIN + angle, mask=ok, other=0.0)
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        if INVERSE:
            s = -s
        tl.store(OUT + o_row[:, None] + offs[None, :], (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=ok)
        tl.store(OUT + o_row[:, None] + HALF + offs[None, :], (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=ok)
    else:
        offs = tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (offs < D)[None, :]
        x = tl.load(X + x_row[:, None] + offs[None, :], mask=ok, other=0.0)
        tl.store(OUT + o_row[:, None] + offs[None, :], x.to(OUT.dtype.element_ty), mask=ok)
