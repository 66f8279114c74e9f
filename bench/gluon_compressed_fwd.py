"""A spike: the compressed branch's forward, warp-specialized as FlashAttention-3 does it, in Gluon, against our
Triton (tl) range forward, same run.

Why. The paper 1 x 64k row (issue 4) is 12 ms short, and the compressed branch's three range kernels are most of
the gap: at head dim 128 they take 1.2-1.3x cuDNN's time on the same problem (kernels-notes v48). v30 tried
FlashAttention-3's order inside one warpgroup (a tile's softmax under the previous tile's P V) in Gluon and found
it tied the tl kernel on the window branch, whose loops are 9 tiles long. It left FlashAttention-3's other half
untried: warp specialization. One copy warp keeps a ring of K/V tiles full through TMA while math warps do
nothing but matrix products and softmax, and two math warpgroups share each K/V tile (128 query rows a tile,
64 a warpgroup), so a tile is read from L2 once for twice the rows. At paper 64k the compressed loops are long
(4095 compressed tokens; a 128-query tile walks 32 64-key tiles on average), the case those help.

Schedule of one program (128 consecutive queries of one head), kernel `compressed_fwd_ws_kernel`:
- a loader partition (LOADER_WARPS warps, few registers): q once, then K/V tile j into slot j % STAGES after
  the consumers freed it (mbarrier `kv_empty`), announcing it on `kv_ready`;
- SPLIT = 0: one consumer, the default partition of 8 warps, 128 rows (the MMA spans both warpgroups);
  SPLIT = 1: two consumers of 4 warps and 64 rows each (the default partition and a worker), each on its own
  schedule; PINGPONG = 1 makes them take turns issuing their matrix products (FlashAttention-3's scheduler
  barriers), so one's softmax runs while the other's products are on the tensor cores;
- each consumer: issue S_j = Q K_j^T and acc += P_{j-1} V_{j-1}; wait for S_j only; softmax of S_j; wait for
  P V; free slot j - 1; acc *= alpha_j. The visibility mask only on tiles not seen whole by every row.

The compressed branch (NSA_SPEC.md section 1): query t sees compressed token j iff j d + l - 1 <= t.

Outcome on the H200 (bench/results/gluon-compressed-fwd-h200-2026-12-03-v84{a,b,c}.md, kernels-notes.md v84): every
variant matches the tl kernel (o within one bf16 ulp, 0.0078 at paper shapes; lse within 2e-6). The best, two
consumers taking turns with q in registers on 64-key tiles, is 1.09x tl at paper 64k (8.63 against 9.44 ms, 509
TFLOP/s against 466; cuDNN's dense causal forward 594), 1.06x at 32k, 1.02x at 16k, 0.95x at 8k and 0.83-0.87x at
nsa-125m (head dim 64). Turns are worth 6% over two consumers without them (128-key tiles), q in registers 4%; one
8-warp consumer loses to tl everywhere. The tl forward already runs at 71-85% of cuDNN's forward rate at paper
32k-64k, so the forward holds about 0.8 ms of the paper 64k row's missing 12: the kernel is not adopted (a Gluon
kernel runs only on Hopper GPUs, never in CI's interpreter); the file stays as the measurement.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_compressed_fwd.py --out DIR [--shapes paper:1:65536,...]
[--suffix S] (checks each variant against the tl kernel's o and lse, then times both; JSON and markdown).
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.provenance import file_suffix, git_commit, result_file, result_stem
from bench.shapes import FAMILIES, PAPER_NSA, family_shapes

LOG2E = 1.4426950408889634
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMP_BLOCK, CMP_STRIDE = PAPER_NSA.cmp_block, PAPER_NSA.cmp_stride  # NSA's l and d at every issue-4 row


@gluon.jit
def _visible_keys(t, key_stride, key_offset, num_keys):
    """How many compressed tokens query t sees: j = 0 .. n - 1 with j key_stride + key_offset <= t."""
    # (t - key_offset) // key_stride + 1 for t >= key_offset, else 0; the dividend is never negative, as integer
    # division truncates toward zero here, not down
    n = gl.maximum(t - key_offset + key_stride, 0) // key_stride
    return gl.minimum(n, num_keys)


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, MASKED: gl.constexpr):
    """P (fp32) of one score tile, the new running max and sum, and alpha = exp2(m_old - m_new)."""
    s = s * qk_scale
    if MASKED:
        visible = gl.expand_dims(offs_n * key_stride + key_offset, 0) <= gl.expand_dims(offs_m, 1)
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay zeros
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = m_new
    p = gl.exp2(s - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, j, n_full):
    if j >= n_full:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, True)
    else:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, False)
    return p, m_new, l_new, alpha


@gluon.jit
def _free_slot(kv_empty, slot, SYNC: gl.constexpr):
    """The consumer is done with slot's K/V: one arrive. With 8 warps (two warpgroups) every warp must be past
    its wait first, as the arrive comes from one thread."""
    if SYNC:
        gl.thread_barrier()
    mbarrier.arrive(kv_empty.index(slot), count=1)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, LSE, t_first, b, h, T, num_keys,
              qk_scale, key_stride, key_offset, n_tiles, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr,
              Q_IN_REGS: gl.constexpr, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """ROWS query rows from t_first: attention over the loader's n_tiles K/V tiles; writes o (through q's shared
    memory, which it no longer needs) and lse."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    SYNC: gl.constexpr = WARPS > 4
    # the other consumer's turn barrier is waited with the opposite parity, so that consumer 0 goes first
    FIRST: gl.constexpr = 1 if CONSUMER == 0 else 0

    offs_m = t_first + gl.arange(0, ROWS, layout=rows_s)
    n_full = _visible_keys(t_first, key_stride, key_offset, num_keys) // BLOCK_N  # tiles every row sees whole
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
    acc = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        if Q_IN_REGS:  # Q K^T's left operand from registers: the K tile is then the only shared-memory read
            qa = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            qa = q_smem
        mbarrier.wait(kv_ready.index(0), 0)
        s_tok = warpgroup_mma(qa, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, 0, n_full)
        p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(kv_ready.index(slot), (j // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(CONSUMER), ((j - 1) & 1) ^ FIRST)
            s_tok = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))  # in-order completion: P V may still run
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_s)
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, offs_m, offs_n, qk_scale, key_stride, key_offset, j,
                                               n_full)
            acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
            _free_slot(kv_empty, prev, SYNC)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
            p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        last = (n_tiles - 1) % STAGES
        acc_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
        _free_slot(kv_empty, last, SYNC)

    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    gl.store(LSE + (b * T + offs_m).to(gl.int64) * H + h, lse, mask=offs_m < T)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
    if SYNC:
        gl.thread_barrier()  # both warpgroups' last Q K^T are done before q's memory takes o
    q_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    if SYNC:
        gl.thread_barrier()  # every warp's part of o is in shared memory before the one TMA store
    tma.async_copy_shared_to_global(o_desc, [b * T + t_first, h * D], q_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, q_row, q_col, kv_row,
            kv_col, n_tiles, NQ: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """q's NQ parts once, then K/V tile j into slot j % STAGES as soon as the consumers have freed it."""
    if n_tiles > 0:
        mbarrier.expect(q_bar, NQ * q_desc.block_type.nbytes)
        for i in gl.static_range(NQ):
            tma.async_copy_global_to_shared(q_desc, [q_row + i * ROWS, q_col], q_bar, q_smem.index(i))
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)  # a fresh slot passes (phase 1 as done)
            mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], kv_ready.index(slot),
                                            k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], kv_ready.index(slot),
                                            v_smem.index(slot))


@gluon.jit
def compressed_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, T, num_keys, qk_scale, key_stride, key_offset,
                             H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                             PINGPONG: gl.constexpr, Q_IN_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                             LOADER_REGS: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    gl.static_assert(SPLIT == 1 or PINGPONG == 0, "turns need two consumers")
    NQ: gl.constexpr = 2 if SPLIT else 1
    ROWS: gl.constexpr = BLOCK_M // NQ
    gl.static_assert(ROWS == 16 * num_warps, "each consumer warp owns 16 query rows")
    n_m = gl.num_programs(0)
    t_first = (n_m - 1 - gl.program_id(0)) * BLOCK_M  # longest tiles first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // (H // G)
    n_tiles = gl.cdiv(_visible_keys(t_first + BLOCK_M - 1, key_stride, key_offset, num_keys), BLOCK_N)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NQ)  # each consumer frees a slot once
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    if SPLIT:
        gl.warp_specialize([
            (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, LSE, t_first, b,
                         h, T, num_keys, qk_scale, key_stride, key_offset, n_tiles, 0, PINGPONG, Q_IN_REGS, H, D,
                         ROWS, BLOCK_N, STAGES, num_warps)),
            (_consumer, (q_smem.index(1), k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, LSE,
                         t_first + ROWS, b, h, T, num_keys, qk_scale, key_stride, key_offset, n_tiles, 1, PINGPONG,
                         Q_IN_REGS, H, D, ROWS, BLOCK_N, STAGES, num_warps)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, b * T + t_first,
                        h * D, b * num_keys, g * D, n_tiles, NQ, ROWS, BLOCK_N, STAGES)),
        ], [num_warps, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem.index(0), k_smem, v_smem, q_bar, kv_ready, kv_empty, turn, o_desc, LSE, t_first, b,
                         h, T, num_keys, qk_scale, key_stride, key_offset, n_tiles, 0, 0, Q_IN_REGS, H, D, ROWS,
                         BLOCK_N, STAGES, num_warps)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty, b * T + t_first,
                        h * D, b * num_keys, g * D, n_tiles, NQ, ROWS, BLOCK_N, STAGES)),
        ], [LOADER_WARPS], [LOADER_REGS])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


def _desc(x2d: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(x2d, list(x2d.shape), list(x2d.stride()), block, layout)


VARIANT_FIELDS = ("block_n", "stages", "split", "pingpong", "q_in_regs", "loader_warps", "loader_regs",
                  "consumer_regs", "maxnreg")
VARIANTS = [  # VARIANT_FIELDS
    (64, 3, 0, 0, 0, 4, 24, 0, 168),
    (64, 3, 1, 1, 0, 4, 24, 240, 168),
    (64, 3, 1, 1, 1, 4, 24, 240, 168),
    (64, 4, 1, 1, 0, 4, 24, 240, 168),
    (64, 4, 1, 1, 1, 4, 24, 240, 168),
    (128, 2, 1, 1, 0, 4, 24, 240, 168),
    (128, 2, 1, 1, 1, 4, 24, 240, 168),
]


def compressed_fwd_ws(q, k, v, scale: float, cmp_block: int = CMP_BLOCK, cmp_stride: int = CMP_STRIDE,
                      block_n: int = 64, stages: int = 3, split: int = 1, pingpong: int = 1, q_in_regs: int = 0,
                      loader_warps: int = 4, loader_regs: int = 24, consumer_regs: int = 240, maxnreg: int = 168,
                      block_m: int = 128, fill: float | None = None):
    """(o, lse) of the compressed branch: q [B, T, H, D], compressed k and v [B, Tc, G, D], bf16, contiguous.
    fill: the outputs start as this value (NaN for a check: a row the kernel misses cannot pass for an earlier
    call's result)."""
    B, T, H, D = q.shape
    Tc, G = k.shape[1], k.shape[2]
    if T % block_m:
        raise ValueError(f"the spike needs T ({T}) a multiple of the query tile ({block_m})")
    if D not in (64, 128) or H % G:
        raise ValueError(f"the spike takes head dim 64 or 128 and H a multiple of G; got D={D}, H={H}, G={G}")
    rows = block_m // (2 if split else 1)
    o = torch.empty_like(q)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    if fill is not None:
        o.fill_(fill)
        lse.fill_(fill)
    compressed_fwd_ws_kernel[(T // block_m, B * H)](
        _desc(q.view(B * T, H * D), [rows, D]), _desc(k.reshape(B * Tc, G * D), [block_n, D]),
        _desc(v.reshape(B * Tc, G * D), [block_n, D]), _desc(o.view(B * T, H * D), [rows, D]), lse, T, Tc,
        scale * LOG2E, cmp_stride, cmp_block - 1, H=H, G=G, D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        SPLIT=split, PINGPONG=pingpong, Q_IN_REGS=q_in_regs, LOADER_WARPS=loader_warps, LOADER_REGS=loader_regs,
        CONSUMER_REGS=consumer_regs, num_warps=rows // 16, maxnreg=maxnreg)
    return o, lse


def _tl_compressed(q, k, v, scale):
    from nsa_model.ops import triton_impl as ti
    return ti._range_fwd(q, k, v, *ti._cmp_range(CMP_BLOCK, CMP_STRIDE, q.shape[1]), scale)


def compressed_flops(B: int, T: int, H: int, D: int) -> int:
    """Forward FLOPs of the compressed branch: 4 D per (query, visible token) pair and head."""
    pairs = sum(min(max((t - CMP_BLOCK + 1) // CMP_STRIDE + 1, 0), (T - CMP_BLOCK) // CMP_STRIDE + 1)
                for t in range(T))
    return 4 * B * H * D * pairs


def _dense_cudnn_fwd(B, T, H, G, D) -> dict:
    """Dense causal cuDNN attention's forward FLOP rate at this shape (GQA): the bar a forward kernel aims at."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), warmup=5, rep=100)
    return dict(cudnn_fwd_ms=ms, cudnn_fwd_tflops=4 * B * H * D * (T * (T + 1) // 2) / ms / 1e9)


def _variant_name(e: dict) -> str:
    consumers = "2 x 4 warps" + (", turns" if e["pingpong"] else "") if e["split"] else "1 x 8 warps"
    consumers += ", q in registers" if e.get("q_in_regs") else ""
    return (f"128x{e['block_n']}, {e['stages']} stages, {consumers}, loader {e['loader_warps']} warps, "
            f"maxnreg {e['maxnreg']}")


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl kernel, then each Gluon variant as time, FLOP rate, ratio to tl and errors against tl."""
    lines = [f"# Compressed-branch forward, warp-specialized Gluon against the tl kernel: {meta['device']}, "
             f"{meta['date'][:16]}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, l = {CMP_BLOCK}, "
             f"d = {CMP_STRIDE}, bf16, median of triton.testing.do_bench. vs tl > 1: the Gluon kernel is faster. "
             "Errors: max abs difference from the tl kernel's o and lse.", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl `range_attn_fwd_kernel` (compressed only): {r['tl_ms']:.3f} ms, {r['tl_tflops']:.0f} "
                  f"TFLOP/s; dense causal cuDNN forward at this shape: {r['cudnn_fwd_tflops']:.0f} TFLOP/s", "",
                  "| Gluon variant | ms | TFLOP/s | vs tl | o err | lse err |", "|---|---|---|---|---|---|"]
        for e in r["variants"]:
            if "error" in e:
                lines.append(f"| {_variant_name(e)} | {e['error']} | | | | |")
            else:
                lines.append(f"| {_variant_name(e)} | {e['ms']:.3f} | {e['tflops']:.0f} | {e['vs_tl']:.3f} | "
                             f"{e['o_err']:.2g} | {e['lse_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


def _measure(entry: dict, run, o_ref, lse_ref, flops: int, t_ref: float) -> None:
    """Errors against the tl kernel's output (NaN-filled first, so a row never written cannot pass), then the
    time; a variant that fails is recorded, not fatal."""
    try:
        o, lse = run(fill=float("nan"))
        torch.cuda.synchronize()
        entry["o_err"] = float((o.float() - o_ref.float()).abs().max())
        finite = torch.isfinite(lse_ref)
        entry["lse_err"] = float((lse[finite] - lse_ref[finite]).abs().max())
        entry["same_empty"] = bool(torch.equal(lse == float("-inf"), lse_ref == float("-inf")))
        ms = triton.testing.do_bench(run, warmup=20, rep=200)
        entry.update(ms=ms, tflops=flops / ms / 1e9, vs_tl=t_ref / ms)
    except Exception as exc:  # a variant that does not compile or fit is a result of the spike
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def _inputs(family: str, B: int, T: int):
    """q [B, T, H, D] and compressed k, v [B, Tc, G, D] in bf16 from a fixed seed (the parent and each variant's
    process build the same tensors), and the softmax scale."""
    H, G, D = (FAMILIES[family][x] for x in "HGD")
    Tc = (T - CMP_BLOCK) // CMP_STRIDE + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(B, Tc, G, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    return q, k, v, 1.0 / math.sqrt(D)


def _variant_process(spec: dict) -> dict:
    """One variant at one shape, in a process of its own (a warp-specialized kernel that deadlocks must not take
    the run with it): its check against the tl kernel, then its time."""
    q, k, v, scale = _inputs(spec["family"], spec["B"], spec["T"])
    o_ref, lse_ref = _tl_compressed(q, k, v, scale)
    entry = dict(spec["variant"])

    def run(fill=None):
        return compressed_fwd_ws(q, k, v, scale, fill=fill, **spec["variant"])
    _measure(entry, run, o_ref, lse_ref, spec["flops"], spec["tl_ms"])
    return entry


def run_variant(script: str, spec: dict, timeout_s: float) -> dict:
    """Run `script --variant-spec spec` (one variant at one shape) in a process of its own and return its entry; a
    deadlock or a crash becomes the entry's error. Shared by the compressed-branch spikes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        run = subprocess.run([sys.executable, script, "--variant-spec", json.dumps(spec)], capture_output=True,
                             text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return dict(spec["variant"], error=f"no result within {timeout_s:.0f} s (deadlock or far too slow)")
    if run.returncode:
        return dict(spec["variant"], error=f"exit {run.returncode}: {run.stderr[-300:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def spike_arguments(doc: str, n_variants: int) -> argparse.ArgumentParser:
    """The compressed-branch spikes' command line: --out, --commit, --shapes, --suffix, the variants and their
    time limit, and the internal --variant-spec."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--commit", default="", help="commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--shapes", type=family_shapes, default=family_shapes("paper:1:16384,paper:1:65536"))
    ap.add_argument("--suffix", type=file_suffix, default="", help="suffix of the results file names")
    ap.add_argument("--variant-timeout", type=float, default=120.0, help="seconds a variant's process may take")
    ap.add_argument("--variants", type=lambda text: [int(i) for i in text.split(",")],
                    default=list(range(n_variants)), help="indexes into VARIANTS (default: all)")
    ap.add_argument("--variant-spec", help=argparse.SUPPRESS)  # internal: run one variant in this process
    return ap


def main() -> int:
    ap = spike_arguments(__doc__, len(VARIANTS))
    args = ap.parse_args()
    if args.variant_spec:
        print(json.dumps(_variant_process(json.loads(args.variant_spec))))
        return 0
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for family, B, T in args.shapes:
        q, k, v, scale = _inputs(family, B, T)
        H, G, D = q.shape[2], k.shape[2], q.shape[3]
        triton.testing.do_bench(lambda: _tl_compressed(q, k, v, scale), warmup=20, rep=200)  # clocks up
        t_ref = triton.testing.do_bench(lambda: _tl_compressed(q, k, v, scale), warmup=20, rep=200)
        flops = compressed_flops(B, T, H, D)
        row = dict(shape=f"{family}_{B}x{T}", B=B, T=T, H=H, G=G, D=D, tl_ms=t_ref, tl_tflops=flops / t_ref / 1e9,
                   variants=[])
        row.update(_dense_cudnn_fwd(B, T, H, G, D))
        for index in args.variants:
            variant = VARIANTS[index]
            spec = dict(family=family, B=B, T=T, flops=flops, tl_ms=t_ref, variant=dict(zip(VARIANT_FIELDS, variant)))
            entry = run_variant(__file__, spec, args.variant_timeout)
            row["variants"].append(entry)
            print(row["shape"], entry, flush=True)
        rows.append(row)
    stem, meta = result_stem(args.out, "gluon-compressed-fwd", args.suffix, args.commit or git_commit())
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows))
    print(report(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
