"""The gated combination of the three branches (NSA_SPEC.md section 6), forward and backward, one kernel each.

    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win        (one gate per (b, t, h), broadcast over the head dim)

In eager PyTorch this is five elementwise kernels forward and about ten backward, each re-reading [B, T, H, DV]
tensors; here the forward reads the three branch outputs once and the backward reads do and them once, writing
the three branch gradients and the gate gradients (a row sum) in the same pass. Arithmetic is fp32.

Layouts (contiguous): gates [ROWS, 3], o_* and do [ROWS, DV], ROWS = B * T * H.
"""

import triton
import triton.language as tl


@triton.jit
def gated_sum_fwd_kernel(GATES, O_CMP, O_SLC, O_WIN, O, num_rows, DV: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    ok = r_ok[:, None] & (offs_d < DV)[None, :]
    at = rows64[:, None] * DV + offs_d[None, :]
    g_cmp = tl.load(GATES + rows64 * 3, mask=r_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(GATES + rows64 * 3 + 1, mask=r_ok, other=0.0).to(tl.float32)
    g_win = tl.load(GATES + rows64 * 3 + 2, mask=r_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * tl.load(O_CMP + at, mask=ok, other=0.0).to(tl.float32)
    o += g_slc[:, None] * tl.load(O_SLC + at, mask=ok, other=0.0).to(tl.float32)
    o += g_win[:, None] * tl.load(O_WIN + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(O + at, o.to(O.dtype.element_ty), mask=ok)


@triton.jit
def _branch_grads(GATE, O_X, DO_X, DGATE, do, at, ok, rows64, r_ok):
    """One branch: d o_x = g_x * do, d g_x = sum over the head dim of do * o_x."""
    g = tl.load(GATE + rows64 * 3, mask=r_ok, other=0.0).to(tl.float32)
    o_x = tl.load(O_X + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(DO_X + at, (g[:, None] * do).to(DO_X.dtype.element_ty), mask=ok)
    tl.store(DGATE + rows64 * 3, tl.sum(do * o_x, axis=1).to(DGATE.dtype.element_ty), mask=r_ok)


@triton.jit
def gated_sum_bwd_kernel(GATES, O_CMP, O_SLC, O_WIN, DO, DGATES, DO_CMP, DO_SLC, DO_WIN, num_rows,
                         DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    ok = r_ok[:, None] & (offs_d < DV)[None, :]
    at = rows64[:, None] * DV + offs_d[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    _branch_grads(GATES, O_CMP, DO_CMP, DGATES, do, at, ok, rows64, r_ok)
    _branch_grads(GATES + 1, O_SLC, DO_SLC, DGATES + 1, do, at, ok, rows64, r_ok)
    _branch_grads(GATES + 2, O_WIN, DO_WIN, DGATES + 2, do, at, ok, rows64, r_ok)
