"""The gated combination of the three branches (NSA_SPEC.md section 6), forward and backward, one kernel each.

    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win        (one gate per (b, t, h), broadcast over the head dim)

In eager PyTorch this is five elementwise kernels forward and about ten backward, each re-reading [B, T, H, DV]
tensors; here the forward reads the three branch outputs once and the backward reads do and them once, writing
the three branch gradients and the gate gradients (a row sum) in the same pass, and on request each branch's
backward row term (HAS_DELTA), so no attention backward re-reads do and o_i for it.
With STORE_GRADS = False the branch gradients d o_i = g_i * do are not stored at all. Each branch's backward
kernels then read do itself and scale by g_i the rows of what they hold in registers (`gate_rows`): P for dV,
and through it dS for dK and dQ (or dQ once at the end), since with d o_i = g_i * do

    dV = (g_i P)^T do,   dS = g_i P (do V^T - rowsum(do * o_i)),

and the row term is then rowsum(do * o_i), which is also d g_i. Scaling do as it is loaded would be the same
arithmetic, but do is an operand of dV's matmul that the GPU reads from shared memory: a do changed in registers
goes back through shared memory on every tile (measured: +7 ms per step in each of two dK/dV kernels, H100).
Arithmetic is fp32.

Layouts (contiguous): gates [ROWS, 3], o_* and do [ROWS, DV], ROWS = B * T * H.
"""

import triton
import triton.language as tl


@triton.jit
def gate_rows(x, GATES, rows, rows_ok, GATE_IDX, HAS_GATE: tl.constexpr):
    """x [R, N] (fp32, row r belonging to the flat (b, t, h) index rows[r]) with each row times its gate of branch
    GATE_IDX; x itself without HAS_GATE."""
    if HAS_GATE:
        x = x * tl.load(GATES + rows * 3 + GATE_IDX, mask=rows_ok, other=0.0).to(tl.float32)[:, None]
    return x


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
def _branch_grads(GATE, O_X, DO_X, DGATE, DELTA_X, do, at, ok, rows64, r_ok, HAS_DELTA: tl.constexpr,
                  STORE_GRADS: tl.constexpr):
    """One branch: d o_x = g_x * do, d g_x = sum over the head dim of do * o_x; with HAS_DELTA also the branch
    backward's row term. With STORE_GRADS that is sum(d o_x * o_x), from d o_x as stored (rounded to its dtype),
    to cancel against the dP the attention backward computes from that same stored d o_x; without, the branch
    backward reads do and gates its rows itself (`gate_rows`), so the row term is sum(do * o_x) = d g_x in fp32."""
    g = tl.load(GATE + rows64 * 3, mask=r_ok, other=0.0).to(tl.float32)
    o_x = tl.load(O_X + at, mask=ok, other=0.0).to(tl.float32)
    do_x = (g[:, None] * do).to(DO_X.dtype.element_ty)
    if STORE_GRADS:
        tl.store(DO_X + at, do_x, mask=ok)
    dgate = tl.sum(do * o_x, axis=1)
    tl.store(DGATE + rows64 * 3, dgate.to(DGATE.dtype.element_ty), mask=r_ok)
    if HAS_DELTA:
        if STORE_GRADS:
            tl.store(DELTA_X + rows64, tl.sum(do_x.to(tl.float32) * o_x, axis=1), mask=r_ok)
        else:
            tl.store(DELTA_X + rows64, dgate, mask=r_ok)


@triton.jit
def gated_sum_bwd_kernel(GATES, O_CMP, O_SLC, O_WIN, DO, DGATES, DO_CMP, DO_SLC, DO_WIN, DELTA, num_rows,
                         DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr,
                         STORE_GRADS: tl.constexpr):
    """DELTA (with HAS_DELTA): [3, ROWS] fp32, each branch's row term, in the order cmp, slc, win. DO_X are
    stored only with STORE_GRADS (they only give the dtype otherwise)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    ok = r_ok[:, None] & (offs_d < DV)[None, :]
    at = rows64[:, None] * DV + offs_d[None, :]
    do = tl.load(DO + at, mask=ok, other=0.0).to(tl.float32)
    _branch_grads(GATES, O_CMP, DO_CMP, DGATES, DELTA, do, at, ok, rows64, r_ok, HAS_DELTA, STORE_GRADS)
    _branch_grads(GATES + 1, O_SLC, DO_SLC, DGATES + 1, DELTA + num_rows, do, at, ok, rows64, r_ok, HAS_DELTA,
                  STORE_GRADS)
    _branch_grads(GATES + 2, O_WIN, DO_WIN, DGATES + 2, DELTA + 2 * num_rows, do, at, ok, rows64, r_ok, HAS_DELTA,
                  STORE_GRADS)
