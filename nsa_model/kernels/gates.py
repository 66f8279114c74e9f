"""The gated combination of the three branches (NSA_SPEC.md section 6), forward and backward, one kernel each.

    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win        (one gate per (b, t, h), broadcast over the head dim)

In eager PyTorch this is five elementwise kernels forward and about ten backward, each re-reading [B, T, H, DV]
tensors; here the forward reads the three branch outputs once and the backward reads do and them once, writing
the three branch gradients and the gate gradients (a row sum) in the same pass.
With FOLD the branch gradients d o_i = g_i * do are not stored at all: the gate goes into each branch's
log-sum-exp instead (LSE_G), and the kernel writes each branch's backward row term (DELTA), so no attention
backward re-reads do and o_i for it. The branch backward reads do itself and lse_i - ln g_i for its lse, so the
probabilities it recomputes are g_i P, and with d o_i = g_i * do

    dV = (g_i P)^T do,   dS = (g_i P) (do V^T - rowsum(do * o_i)),

which is the attention backward of do with that lse and the row term rowsum(do * o_i) (= d g_i, in fp32). The
branch kernels thus do no gate work at all. (Gating do as it is loaded costs the same arithmetic, but do is an
operand of dV's matmul, read from shared memory, and a do changed in registers has to go back there on every
tile: +7 ms per step in each of two dK/dV kernels on the H100, v14 in kernels-notes.md.) This needs gates >= 0,
as NSA's are (sigmoids, NSA_SPEC.md); g = 0 gives lse = +inf, so P = 0. Arithmetic is fp32.

Layouts (contiguous): gates [ROWS, 3], o_* and do [ROWS, DV], ROWS = B * T * H.
"""

import triton
import triton.language as tl


@triton.jit
def gate_rows(GATES, rows64, r_ok, o_cmp, o_slc, o_win):
    """g_cmp * o_cmp + g_slc * o_slc + g_win * o_win (fp32) of rows rows64 (int64) of the [ROWS, 3] gates, the branch
    outputs given as fp32 [rows, BLOCK_D] of their stored values. The forward kernel below and by_block's combine
    with its gated epilogue (selected_by_block.py) both sum through it, so the two give the same o."""
    g_cmp = tl.load(GATES + rows64 * 3, mask=r_ok, other=0.0).to(tl.float32)
    g_slc = tl.load(GATES + rows64 * 3 + 1, mask=r_ok, other=0.0).to(tl.float32)
    g_win = tl.load(GATES + rows64 * 3 + 2, mask=r_ok, other=0.0).to(tl.float32)
    o = g_cmp[:, None] * o_cmp
    o += g_slc[:, None] * o_slc
    o += g_win[:, None] * o_win
    return o


@triton.jit
def gated_sum_fwd_kernel(GATES, O_CMP, O_SLC, O_WIN, O, num_rows, DV: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    ok = r_ok[:, None] & (offs_d < DV)[None, :]
    at = rows64[:, None] * DV + offs_d[None, :]
    o = gate_rows(GATES, rows64, r_ok, tl.load(O_CMP + at, mask=ok, other=0.0).to(tl.float32),
                  tl.load(O_SLC + at, mask=ok, other=0.0).to(tl.float32),
                  tl.load(O_WIN + at, mask=ok, other=0.0).to(tl.float32))
    tl.store(O + at, o.to(O.dtype.element_ty), mask=ok)


@triton.jit
def _branch_grads(GATE, O_X, DO_X, DGATE, DELTA_X, LSE_X, LSE_G_X, do, at, ok, rows64, r_ok, FOLD: tl.constexpr):
    """One branch: d g_x = sum over the head dim of do * o_x, and d o_x = g_x * do stored; with FOLD instead the
    gate goes into the branch's lse (LSE_G_X = lse - ln g, -inf kept where no key is seen) and the branch
    backward's row term is stored, sum(do * o_x) = d g_x in fp32, as that backward then reads do itself."""
    g = tl.load(GATE + rows64 * 3, mask=r_ok, other=1.0).to(tl.float32)  # 1: no log(0) on padding rows
    o_x = tl.load(O_X + at, mask=ok, other=0.0).to(tl.float32)
    dgate = tl.sum(do * o_x, axis=1)
    tl.store(DGATE + rows64 * 3, dgate.to(DGATE.dtype.element_ty), mask=r_ok)
    if FOLD:
        tl.store(DELTA_X + rows64, dgate, mask=r_ok)
        lse = tl.load(LSE_X + rows64, mask=r_ok, other=0.0)
        tl.store(LSE_G_X + rows64, tl.where(lse == float("-inf"), lse, lse - tl.log(g)), mask=r_ok)
    else:
        tl.store(DO_X + at, (g[:, None] * do).to(DO_X.dtype.element_ty), mask=ok)


@triton.jit
def gated_sum_bwd_kernel(GATES, O_CMP, O_SLC, O_WIN, DO, DGATES, DO_CMP, DO_SLC, DO_WIN, DELTA, LSE_CMP, LSE_SLC,
                         LSE_WIN, LSE_G, num_rows, DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         FOLD: tl.constexpr):
    """With FOLD: DELTA [3, ROWS] fp32, each branch's row term, in the order cmp, slc, win, and LSE_G [3, ROWS]
    fp32, each branch's lse [ROWS] (LSE_X) less ln of its gate; DO_X then only give the dtype. Without: DO_X
    stored, DELTA, LSE_X and LSE_G unread."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    ok = r_ok[:, None] & (offs_d < DV)[None, :]
    at = rows64[:, None] * DV + offs_d[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    _branch_grads(GATES, O_CMP, DO_CMP, DGATES, DELTA, LSE_CMP, LSE_G, do, at, ok, rows64, r_ok, FOLD)
    _branch_grads(GATES + 1, O_SLC, DO_SLC, DGATES + 1, DELTA + num_rows, LSE_SLC, LSE_G + num_rows, do, at, ok,
                  rows64, r_ok, FOLD)
    _branch_grads(GATES + 2, O_WIN, DO_WIN, DGATES + 2, DELTA + 2 * num_rows, LSE_WIN, LSE_G + 2 * num_rows, do, at,
                  ok, rows64, r_ok, FOLD)
