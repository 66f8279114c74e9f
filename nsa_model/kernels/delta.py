"""delta[r] = sum_d do[r, d] * o[r, d] in fp32: the row term of every attention backward (FlashAttention-2's D).

One read of do and o in their own dtype. The eager form `(do.float() * o.float()).sum(-1)` writes and re-reads
two fp32 copies and their product: about 7x the traffic, which was a quarter of the compressed branch's backward
at 125M 16 x 2k (bench/results/kernels-notes.md, v5).

Layouts (contiguous): do, o [ROWS, D], delta [ROWS] fp32, ROWS = B * T * H.
"""

import triton
import triton.language as tl


@triton.jit
def row_dot_kernel(DO, O, DELTA, num_rows, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    ok = r_ok[:, None] & (offs_d < D)[None, :]
    at = rows.to(tl.int64)[:, None] * D + offs_d[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(do * o, axis=1), mask=r_ok)
