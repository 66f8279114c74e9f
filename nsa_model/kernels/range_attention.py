"""Attention of each query over a contiguous range of keys: NSA's compressed and window branches.

Key j stands at position j * key_stride + key_offset and query t sees it iff

    0 <= t - (j * key_stride + key_offset) < window

  compressed branch: key_stride = d, key_offset = l - 1 (compressed token j ends there), window = T (no lower bound)
  window branch:     key_stride = 1, key_offset = 0, window = w

Layouts (contiguous): q [B, T, H, DK], k [B, NK, G, DK], v [B, NK, G, DV], o [B, T, H, DV], lse/delta [B, T, H] fp32.
Head h reads kv head h // (H // G). FlashAttention-2 style: forward keeps an online softmax in registers; backward
runs one kernel for dQ (per query tile and head) and one for dK/dV (per key tile and a slice of the group's
heads; see range_attn_bwd_dkdv_kernel). Row offsets are computed in int64 (B*T*H*D can exceed 2^31).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys any query of [t_first, t_last] may see, lo rounded down to a tile."""
    hi = (t_last - key_offset + key_stride) // key_stride
    hi = tl.minimum(tl.maximum(hi, 0), num_keys)
    x = t_first - window - key_offset
    lo = tl.where(x >= 0, x // key_stride + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _visible(offs_m, offs_n, key_stride, key_offset, window):
    rel = offs_m[:, None] - (offs_n[None, :] * key_stride + key_offset)
    return (rel >= 0) & (rel < window)


@triton.jit
def range_attn_fwd_kernel(Q, K, V, O, LSE, T, num_keys, scale, key_stride, key_offset, window,
                          H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // (H // G)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < T
    row_q = (b * T + offs_m).to(tl.int64) * H + h
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=m_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)

    t_first = pid_m * BLOCK_M
    t_last = tl.minimum(t_first + BLOCK_M, T) - 1
    lo, hi = _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N)
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        row_k = (b * num_keys + offs_n).to(tl.int64) * G + g
        k = tl.load(K + row_k[:, None] * DK + offs_dk[None, :], mask=n_ok[:, None] & (offs_dk < DK)[None, :],
                    other=0.0)
        v = tl.load(V + row_k[:, None] * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay exact zeros
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.log2(l_safe)) / LOG2E, float("-inf"))
    tl.store(O + row_q[:, None] * DV + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSE + row_q, lse, mask=m_ok)


@triton.jit
def range_attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, num_keys, scale, key_stride, key_offset, window,
                             H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // (H // G)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < T
    row_q = (b * T + offs_m).to(tl.int64) * H + h
    q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=m_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=m_ok[:, None] & (offs_dv < DV)[None, :],
                 other=0.0)
    lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_q, mask=m_ok, other=0.0)

    t_first = pid_m * BLOCK_M
    t_last = tl.minimum(t_first + BLOCK_M, T) - 1
    lo, hi = _key_tiles(t_first, t_last, key_stride, key_offset, window, num_keys, BLOCK_N)
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        row_k = (b * num_keys + offs_n).to(tl.int64) * G + g
        k = tl.load(K + row_k[:, None] * DK + offs_dk[None, :], mask=n_ok[:, None] & (offs_dk < DK)[None, :],
                    other=0.0)
        v = tl.load(V + row_k[:, None] * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :],
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :]
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq = dq * scale
    tl.store(DQ + row_q[:, None] * DK + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dk < DK)[None, :])


@triton.jit
def range_attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK_ACC, DV_ACC, T, num_keys, scale, key_stride, key_offset,
                               window, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, HEAD_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program per (key tile, slice of HPG / HEAD_SPLIT heads of a group). HEAD_SPLIT = 1: the program loops
    over the whole group and stores (exact, deterministic; right for the window branch, whose tiles see few
    queries). HEAD_SPLIT = HPG: one head per program, the heads meet by float32 atomic adds (keeps the
    many-query tiles of the compressed branch spread over the whole GPU)."""
    HPG: tl.constexpr = H // G
    HEADS: tl.constexpr = HPG // HEAD_SPLIT
    pid_n = tl.program_id(0)
    pid_bgs = tl.program_id(1)
    b = pid_bgs // (G * HEAD_SPLIT)
    g = (pid_bgs // HEAD_SPLIT) % G
    first_head = g * HPG + (pid_bgs % HEAD_SPLIT) * HEADS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < num_keys
    row_k = (b * num_keys + offs_n).to(tl.int64) * G + g
    k = tl.load(K + row_k[:, None] * DK + offs_dk[None, :], mask=n_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    v = tl.load(V + row_k[:, None] * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)

    # Queries that may see this tile: from its first key's position to its last key's position + window - 1.
    first_pos = pid_n * BLOCK_N * key_stride + key_offset
    last_pos = (pid_n * BLOCK_N + BLOCK_N - 1) * key_stride + key_offset
    t_lo = (first_pos // BLOCK_M) * BLOCK_M
    t_hi = tl.minimum(T, last_pos + window)
    qk_scale = scale * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for head in range(HEADS):
        h = first_head + head
        for start_m in range(t_lo, t_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < T
            row_q = (b * T + offs_m).to(tl.int64) * H + h
            q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=m_ok[:, None] & (offs_dk < DK)[None, :],
                        other=0.0)
            do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=m_ok[:, None] & (offs_dv < DV)[None, :],
                         other=0.0)
            lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
            delta = tl.load(DELTA + row_q, mask=m_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :] & m_ok[:, None]
            p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
    dk = dk * scale
    dk_ptrs = DK_ACC + row_k[:, None] * DK + offs_dk[None, :]
    dv_ptrs = DV_ACC + row_k[:, None] * DV + offs_dv[None, :]
    if HEAD_SPLIT == 1:
        tl.store(dk_ptrs, dk, mask=n_ok[:, None] & (offs_dk < DK)[None, :])
        tl.store(dv_ptrs, dv, mask=n_ok[:, None] & (offs_dv < DV)[None, :])
    else:
        tl.atomic_add(dk_ptrs, dk, mask=n_ok[:, None] & (offs_dk < DK)[None, :])
        tl.atomic_add(dv_ptrs, dv, mask=n_ok[:, None] & (offs_dv < DV)[None, :])
