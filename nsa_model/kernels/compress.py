"""phi = mlp (NSA_SPEC.md, "The module around the core"; paper Eq. 7) as Triton kernels, forward and backward.

phi maps each block of l raw vectors (stride d) to one compressed vector: h = W1 . flatten(block) + bias, then
y = W2 . gelu(h) + b2 (the position embedding is already folded into bias, attention.Compressor). In PyTorch
that is an unfold copy of the blocks (l/d copies of every token), two small GEMMs, GELU, and in the backward the
fold-back of the blocks' gradient, about fifteen launches per call that each wait on the one before:
about 5 ms per nsa-125m training step at T = 8192, where the FLOPs are a few microseconds' worth
(bench/results/kernels-notes.md, v29). Here the forward is one launch and the backward three:

- forward, one program per BLOCK_R compressed tokens of one kv group: h = sum over the block's l positions j of
  x[token i*d + j] @ W1[:, j-th D columns]^T (the unfold is only addressing), then GELU and fc2 on chip. h is
  stored (float32) for the backward.
- backward rows: dh = (dy @ W2) * gelu'(h) per row tile, and its share of the row sums that give W2's, b2's and
  bias's gradients (stored per program, summed by the caller).
- backward W1: W1's j-th D columns get sum over rows of dh^T x[token i*d + j], one program per (j, row split)
  (splits are summed by the caller: no atomics on the large tensor).
- backward x: token t = c*d + u is position u + m*d of block c - m for m < l/d, so dx[t] = sum over m of
  dh[c - m] @ W1[:, (u + m*d)-th D columns]: one program per (chunk tile, group, a run of consecutive u), every
  token written once (zeros where no block covers it), no overlap-add.

Sets: one launch runs phi for one or two inputs of the same shape, each with its own weights: NSA's compressed keys
and values (phi_k, phi_v). Every program's last grid axis (the x kernel: its group axis, set * G + g) picks the
set: X0 or X1, and that set's slice of every other tensor. The launches are latency-bound at nsa-125m's sizes
(128 programs of a few microseconds each), so two sets in one launch cost little more than one: k and v
forward and backward went 119.5 -> 102.2 us per layer call at 125M 4 x 8k on the H200 (kernels-notes.md, v32).

Layouts, for S sets: x0, x1 [B, T, G, D] with the same batch, token and group strides (last dimension
contiguous); y [S, B, Tc, G, D] and dx [S, B, T, G, D] contiguous; h and dh [S, B * Tc, G, HID] contiguous (row
r = b * Tc + i); W1 [S, HID, L * D] and W2 [S, D, HID] contiguous, cast to x's dtype as they are loaded (the
forward's W1, read once per step of every program, comes already cast); biases [S, HID] and [S, D] and the
weight gradients float32.
"""

import triton
import triton.language as tl

RSQRT2 = tl.constexpr(0.7071067811865476)
RSQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _set_input(X0, X1, s):
    """The input of set s (0 or 1)."""
    X = X0
    if s == 1:
        X = X1
    return X


@triton.jit
def _block_rows(pid, R, TC, x_sb, x_st, x_sg, g, STRIDE: tl.constexpr, BLOCK_R: tl.constexpr):
    """(row ids, ok, offset of each row's first token in x) of compressed tokens r = b * Tc + i."""
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    b = (r // TC).to(tl.int64)
    i = (r % TC).to(tl.int64)
    return r, r_ok, b * x_sb + i * STRIDE * x_st + g * x_sg


@triton.jit
def phi_fwd_kernel(X0, X1, W1, BIAS1, W2, B2, Y, HS, R, TC, x_sb, x_st, x_sg,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HID: tl.constexpr,
                   BLOCK_H: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    g = tl.program_id(1)
    s = tl.program_id(2)
    X = _set_input(X0, X1, s)
    W1 += s.to(tl.int64) * HID * (L * D)
    BIAS1 += s * HID
    W2 += s * D * HID
    B2 += s * D
    Y += s.to(tl.int64) * R * G * D
    HS += s.to(tl.int64) * R * G * HID
    r, r_ok, x_row = _block_rows(tl.program_id(0), R, TC, x_sb, x_st, x_sg, g, STRIDE, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_ok = offs_d < D
    h_ok = offs_h < HID
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for j in range(L):
        x = tl.load(X + x_row[:, None] + j * x_st + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        w1 = tl.load(W1 + offs_h[None, :] * (L * D) + j * D + offs_d[:, None], mask=d_ok[:, None] & h_ok[None, :],
                     other=0.0)
        acc += tl.dot(x, w1.to(x.dtype), input_precision=DOT_PRECISION)
    h = acc + tl.load(BIAS1 + offs_h, mask=h_ok, other=0.0)[None, :]
    row_h = (r.to(tl.int64) * G + g) * HID
    tl.store(HS + row_h[:, None] + offs_h[None, :], h, mask=r_ok[:, None] & h_ok[None, :])
    a = h * 0.5 * (1.0 + tl.erf(h * RSQRT2))
    w2t = tl.load(W2 + offs_d[None, :] * HID + offs_h[:, None], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    y = tl.dot(a.to(Y.dtype.element_ty), w2t.to(Y.dtype.element_ty), input_precision=DOT_PRECISION)
    y += tl.load(B2 + offs_d, mask=d_ok, other=0.0)[None, :]
    row_y = (r.to(tl.int64) * G + g) * D
    tl.store(Y + row_y[:, None] + offs_d[None, :], y.to(Y.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def phi_bwd_rows_kernel(DY, HS, W2, DH, SUMS, R,
                        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HID: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """SUMS [S, programs, D * HID + D + HID] float32: each program's share of dW2, d b2 and d bias, stored whole
    (the caller sums over programs; float32 atomics from every program cost more than the rest of the kernel)."""
    g = tl.program_id(1)
    s = tl.program_id(2)
    DY += s.to(tl.int64) * R * G * D
    HS += s.to(tl.int64) * R * G * HID
    DH += s.to(tl.int64) * R * G * HID
    W2 += s * D * HID
    SUMS += (s * tl.num_programs(0) * G).to(tl.int64) * (D * HID + D + HID)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_ok = offs_d < D
    h_ok = offs_h < HID
    rd_ok = r_ok[:, None] & d_ok[None, :]
    rh_ok = r_ok[:, None] & h_ok[None, :]
    row_y = (r.to(tl.int64) * G + g) * D
    row_h = (r.to(tl.int64) * G + g) * HID
    dy = tl.load(DY + row_y[:, None] + offs_d[None, :], mask=rd_ok, other=0.0)
    h = tl.load(HS + row_h[:, None] + offs_h[None, :], mask=rh_ok, other=0.0)
    cdf = 0.5 * (1.0 + tl.erf(h * RSQRT2))
    a = h * cdf
    w2 = tl.load(W2 + offs_d[:, None] * HID + offs_h[None, :], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
    da = tl.dot(dy, w2.to(dy.dtype), input_precision=DOT_PRECISION)
    dh = da * (cdf + h * tl.exp(-0.5 * h * h) * RSQRT_2PI)  # rows past R: dy = 0, so dh = 0
    tl.store(DH + row_h[:, None] + offs_h[None, :], dh.to(DH.dtype.element_ty), mask=rh_ok)
    sums = SUMS + (tl.program_id(0) * G + g).to(tl.int64) * (D * HID + D + HID)
    dw2 = tl.dot(tl.trans(dy), a.to(dy.dtype), input_precision=DOT_PRECISION)
    tl.store(sums + offs_d[:, None] * HID + offs_h[None, :], dw2, mask=d_ok[:, None] & h_ok[None, :])
    tl.store(sums + D * HID + offs_d, tl.sum(dy.to(tl.float32), axis=0), mask=d_ok)
    tl.store(sums + D * HID + D + offs_h, tl.sum(dh, axis=0), mask=h_ok)


@triton.jit
def phi_bwd_w1_kernel(X0, X1, DH, DW1, R, TC, tiles_per_split, x_sb, x_st, x_sg,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HID: tl.constexpr,
                      BLOCK_H: tl.constexpr, L: tl.constexpr, STRIDE: tl.constexpr, BLOCK_R: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """DW1 [S, splits, HID, L * D] float32: each split's sum over its row tiles (rows q = r * G + g of dh)."""
    j = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.program_id(2)
    X = _set_input(X0, X1, s)
    DH += s.to(tl.int64) * R * G * HID
    DW1 += (s * tl.num_programs(1)).to(tl.int64) * HID * (L * D)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_ok = offs_d < D
    h_ok = offs_h < HID
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(R * G, BLOCK_R))
    for tile in range(first, last):
        q = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        q_ok = q < R * G
        r = q // G
        b = (r // TC).to(tl.int64)
        i = (r % TC).to(tl.int64)
        x_row = b * x_sb + (i * STRIDE + j) * x_st + (q % G) * x_sg
        x = tl.load(X + x_row[:, None] + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
        dh = tl.load(DH + q.to(tl.int64)[:, None] * HID + offs_h[None, :], mask=q_ok[:, None] & h_ok[None, :],
                     other=0.0)
        acc += tl.dot(tl.trans(dh), x, input_precision=DOT_PRECISION)
    out = DW1 + split.to(tl.int64) * HID * (L * D) + offs_h[:, None] * (L * D) + j * D + offs_d[None, :]
    tl.store(out, acc, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def phi_bwd_x_kernel(DH, W1, DX, T, TC, NCH, NUM_ROWS,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HID: tl.constexpr,
                     BLOCK_H: tl.constexpr, STRIDE: tl.constexpr, PIECES: tl.constexpr, BLOCK_R: tl.constexpr,
                     OFFSETS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dx rows (b, t = c * STRIDE + u) for a tile of (b, c) pairs (NUM_ROWS = B * NCH, NCH = cdiv(T, STRIDE)),
    group g of set s (program_id(1) = s * G + g) and OFFSETS consecutive offsets u from program_id(2) * OFFSETS:
    the offsets of one tile read the same dh rows, so one program takes several (with one offset a program, the
    dh tiles were loaded d = 16 times over from L2 at nsa-125m's sizes: kernels-notes.md v49)."""
    g = tl.program_id(1) % G
    s = tl.program_id(1) // G
    DH += s.to(tl.int64) * TC * (NUM_ROWS // NCH) * G * HID
    W1 += s.to(tl.int64) * HID * (PIECES * STRIDE * D)
    DX += s.to(tl.int64) * (NUM_ROWS // NCH) * T * G * D
    L: tl.constexpr = PIECES * STRIDE
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = rows // NCH
    c = rows % NCH
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    d_ok = offs_d < D
    h_ok = offs_h < HID
    for u in range(tl.program_id(2) * OFFSETS, tl.program_id(2) * OFFSETS + OFFSETS):
        t = c * STRIDE + u
        ok = (rows < NUM_ROWS) & (t < T)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for m in tl.static_range(PIECES):  # t is position u + m * STRIDE of block c - m
            i = c - m
            i_ok = ok & (i >= 0) & (i < TC)
            row_h = ((b.to(tl.int64) * TC + i) * G + g) * HID
            dh = tl.load(DH + row_h[:, None] + offs_h[None, :], mask=i_ok[:, None] & h_ok[None, :], other=0.0)
            w1 = tl.load(W1 + offs_h[:, None] * (L * D) + (u + m * STRIDE) * D + offs_d[None, :],
                         mask=h_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.dot(dh, w1.to(dh.dtype), input_precision=DOT_PRECISION)
        row_x = ((b.to(tl.int64) * T + t) * G + g) * D
        tl.store(DX + row_x[:, None] + offs_d[None, :], acc.to(DX.dtype.element_ty),
                 mask=ok[:, None] & d_ok[None, :])
