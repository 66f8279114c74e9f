"""A spike: the compressed branch's dQ, warp-specialized as bench/gluon_compressed_fwd.py's forward, in Gluon,
against our Triton (tl) range dQ kernel on the compressed range alone, same run.

Why. kernels-notes v84 found FlashAttention-3's warp-specialized form 1.09x the tl forward at paper 64k (long
loops) and projected about as much for the backward's kernels, which hold 8 of the paper 64k row's missing 12 ms
against cuDNN's rate. This measures the projection on the simpler of the two backward kernels: dQ = sum over key
tiles of dS K, dS = P (dP - delta), P = exp(S - lse), S = Q K^T scale, dP = dO V^T (three products a tile).

Schedule of one program (128 consecutive queries of one head), `compressed_dq_ws_kernel`: a loader partition
copies q and dO once and keeps a ring of K/V tiles full (as the forward's); two consumer partitions of 64 rows
each take turns issuing a tile's S and dP products (one's exponentials and dS under the other's products), then
issue dS K into their dQ accumulator and free the tile when it is done. QO_IN_REGS 1 holds q and dO in the
products' register operand layout (K and V are then the products' only shared-memory reads).

Outcome on the H200 (bench/results/gluon-compressed-dq-h200-2026-12-03-v84d.md, kernels-notes.md v84): every
variant's dQ equals the tl kernel's bit for bit (the same 64-key tiles, the same order of float32 adds, no online
softmax to diverge). None is faster: 0.95-0.97x tl at paper 64k, 32k and 8k, q and dO in registers no help, 32-key
tiles 0.91x. The tl dQ kernel already runs its three products at 630 TFLOP/s at paper 64k (565 at 32k), above
cuDNN's 550 for a whole forward + backward: nothing for warp specialization to hide. The projection of v84's forward
onto the backward's kernels does not hold for dQ; the file stays as the measurement.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_compressed_dq.py --out DIR [--shapes paper:1:65536,...]
[--suffix=S] (checks each variant against the tl kernel's dQ, then times both; JSON and markdown).
"""

import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from bench.gluon_compressed_fwd import (CMP_BLOCK, CMP_STRIDE, LOG2E, _desc, _inputs, _visible_keys,
                                        compressed_flops, run_variant, spike_arguments)
from bench.provenance import git_commit, result_file, result_stem


@gluon.jit
def _ds_tile(s, dp, lse2, delta, offs_m, offs_n, qk_scale, key_stride, key_offset, MASKED: gl.constexpr):
    """dS = P (dP - delta) of one tile, P = exp2(S qk_scale - lse2); invisible pairs 0."""
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    if MASKED:
        visible = gl.expand_dims(offs_n * key_stride + key_offset, 0) <= gl.expand_dims(offs_m, 1)
        p = gl.where(visible, p, 0.0)
    return p * (dp - gl.expand_dims(delta, 1))


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, qo_bar, kv_ready, kv_empty, turn, LSE, DELTA, DQ, t_first, b, h,
                 T, num_keys, qk_scale, scale, key_stride, key_offset, n_tiles, CONSUMER: gl.constexpr,
                 QO_IN_REGS: gl.constexpr, H: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """ROWS query rows from t_first: their dQ over the loader's n_tiles K/V tiles, stored in q's dtype."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    FIRST: gl.constexpr = 1 if CONSUMER == 0 else 0

    offs_m = t_first + gl.arange(0, ROWS, layout=rows_s)
    row = (b * T + offs_m).to(gl.int64) * H + h
    lse2 = gl.load(LSE + row) * 1.4426950408889634
    lse2 = gl.where(lse2 == float("-inf"), 0.0, lse2)  # rows that see nothing: every pair masked anyway
    delta = gl.load(DELTA + row)
    n_full = _visible_keys(t_first, key_stride, key_offset, num_keys) // BLOCK_N
    dq = gl.zeros([ROWS, D], gl.float32, layout=dq_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    if n_tiles > 0:
        mbarrier.wait(qo_bar, 0)
        if QO_IN_REGS:
            op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
            qa = q_smem.load(op_layout)
            doa = do_smem.load(op_layout)
        else:
            qa = q_smem
            doa = do_smem
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(kv_ready.index(slot), (j // STAGES) & 1)
            mbarrier.wait(turn.index(CONSUMER), (j & 1) ^ FIRST)
            s_tok = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(doa, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            s, dp = warpgroup_mma_wait(0, deps=(s_tok, dp_tok))
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_s)
            if j >= n_full:
                ds = _ds_tile(s, dp, lse2, delta, offs_m, offs_n, qk_scale, key_stride, key_offset, True)
            else:
                ds = _ds_tile(s, dp, lse2, delta, offs_m, offs_n, qk_scale, key_stride, key_offset, False)
            ds = gl.convert_layout(ds.to(gl.bfloat16), ds_layout)
            dq_tok = warpgroup_mma(ds, k_smem.index(slot), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
            mbarrier.arrive(kv_empty.index(slot), count=1)
    dq = dq * scale
    rows_o: gl.constexpr = gl.SliceLayout(1, dq_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, dq_layout)
    row_o = (b * T + t_first + gl.arange(0, ROWS, layout=rows_o)).to(gl.int64) * H + h
    gl.store(DQ + gl.expand_dims(row_o, 1) * D + gl.expand_dims(gl.arange(0, D, layout=cols_o), 0),
             dq.to(gl.bfloat16))


@gluon.jit
def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qo_bar, kv_ready, kv_empty, q_row,
               q_col, kv_row, kv_col, n_tiles, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """q's and dO's two 64-row parts once, then K/V tile j into slot j % STAGES as soon as both consumers freed
    it."""
    if n_tiles > 0:
        mbarrier.expect(qo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [q_row + i * ROWS, q_col], qo_bar, q_smem.index(i))
            tma.async_copy_global_to_shared(do_desc, [q_row + i * ROWS, q_col], qo_bar, do_smem.index(i))
        for j in range(n_tiles):
            slot = j % STAGES
            mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], kv_ready.index(slot),
                                            k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], kv_ready.index(slot),
                                            v_smem.index(slot))


@gluon.jit
def compressed_dq_ws_kernel(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DQ, T, num_keys, qk_scale, scale,
                            key_stride, key_offset, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            QO_IN_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    ROWS: gl.constexpr = BLOCK_M // 2
    gl.static_assert(ROWS == 16 * num_warps, "each consumer warp owns 16 query rows")
    n_m = gl.num_programs(0)
    t_first = (n_m - 1 - gl.program_id(0)) * BLOCK_M  # longest tiles first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // (H // G)
    n_tiles = gl.cdiv(_visible_keys(t_first + BLOCK_M - 1, key_stride, key_offset, num_keys), BLOCK_N)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
    qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qo_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # each consumer frees a slot once
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_dq_consumer, (q_smem.index(0), do_smem.index(0), k_smem, v_smem, qo_bar, kv_ready, kv_empty, turn, LSE,
                        DELTA, DQ, t_first, b, h, T, num_keys, qk_scale, scale, key_stride, key_offset, n_tiles, 0,
                        QO_IN_REGS, H, D, ROWS, BLOCK_N, STAGES, num_warps)),
        (_dq_consumer, (q_smem.index(1), do_smem.index(1), k_smem, v_smem, qo_bar, kv_ready, kv_empty, turn, LSE,
                        DELTA, DQ, t_first + ROWS, b, h, T, num_keys, qk_scale, scale, key_stride, key_offset,
                        n_tiles, 1, QO_IN_REGS, H, D, ROWS, BLOCK_N, STAGES, num_warps)),
        (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qo_bar, kv_ready, kv_empty,
                      b * T + t_first, h * D, b * num_keys, g * D, n_tiles, ROWS, BLOCK_N, STAGES)),
    ], [num_warps, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    mbarrier.invalidate(qo_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


VARIANT_FIELDS = ("block_n", "stages", "qo_in_regs", "loader_warps", "loader_regs", "consumer_regs", "maxnreg")
VARIANTS = [  # VARIANT_FIELDS
    (64, 2, 0, 4, 24, 240, 168),
    (64, 3, 0, 4, 24, 240, 168),
    (64, 2, 1, 4, 24, 240, 168),
    (64, 3, 1, 4, 24, 240, 168),
    (32, 4, 1, 4, 24, 240, 168),
]


def compressed_dq_ws(q, k, v, do, lse, delta, scale: float, cmp_block: int = CMP_BLOCK, cmp_stride: int = CMP_STRIDE,
                     block_n: int = 64, stages: int = 3, qo_in_regs: int = 1, loader_warps: int = 4,
                     loader_regs: int = 24, consumer_regs: int = 240, maxnreg: int = 168, block_m: int = 128,
                     fill: float | None = None):
    """dQ of the compressed branch: q, do [B, T, H, D]; compressed k and v [B, Tc, G, D], bf16, contiguous; lse and
    delta [B, T, H] float32 (the forward's lse, rowsum(dO o)). fill: dQ starts as this value (NaN for a check)."""
    B, T, H, D = q.shape
    Tc, G = k.shape[1], k.shape[2]
    if T % block_m:
        raise ValueError(f"the spike needs T ({T}) a multiple of the query tile ({block_m})")
    if D not in (64, 128) or H % G:
        raise ValueError(f"the spike takes head dim 64 or 128 and H a multiple of G; got D={D}, H={H}, G={G}")
    rows = block_m // 2
    dq = torch.empty_like(q)
    if fill is not None:
        dq.fill_(fill)
    compressed_dq_ws_kernel[(T // block_m, B * H)](
        _desc(q.view(B * T, H * D), [rows, D]), _desc(do.view(B * T, H * D), [rows, D]),
        _desc(k.reshape(B * Tc, G * D), [block_n, D]), _desc(v.reshape(B * Tc, G * D), [block_n, D]), lse, delta,
        dq, T, Tc, scale * LOG2E, scale, cmp_stride, cmp_block - 1, H=H, G=G, D=D, BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=stages, QO_IN_REGS=qo_in_regs, LOADER_WARPS=loader_warps, LOADER_REGS=loader_regs,
        CONSUMER_REGS=consumer_regs, num_warps=rows // 16, maxnreg=maxnreg)
    return dq


def _tl_setup(family: str, B: int, T: int):
    """The inputs, the tl forward's o and lse, a random dO, delta, and a function running the tl dQ kernel on the
    compressed range alone (as nsa::core's backward launches it, without the window's range or by_block's slots)."""
    from nsa_model.ops import triton_impl as ti
    q, k, v, scale = _inputs(family, B, T)
    cmp = ti._cmp_range(CMP_BLOCK, CMP_STRIDE, T)
    o, lse = ti._range_fwd(q, k, v, *cmp, scale)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
    delta = ti._delta(do, o)
    dq = torch.empty_like(q)

    def tl_dq():
        ti._range_dq_into(q, k, v, do, lse, delta, dq, T, *cmp, scale)
        return dq
    return q, k, v, do, lse, delta, scale, tl_dq


def _variant_name(e: dict) -> str:
    regs = ", q and dO in registers" if e["qo_in_regs"] else ""
    return (f"128x{e['block_n']}, {e['stages']} stages, 2 x 4 warps, turns{regs}, loader {e['loader_warps']} "
            f"warps, maxnreg {e['maxnreg']}")


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl kernel, then each Gluon variant as time, FLOP rate, ratio to tl and error against tl."""
    lines = [f"# Compressed-branch dQ, warp-specialized Gluon against the tl kernel: {meta['device']}, "
             f"{meta['date'][:16]}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, l = {CMP_BLOCK}, "
             f"d = {CMP_STRIDE}, bf16, median of triton.testing.do_bench. vs tl > 1: the Gluon kernel is faster. "
             "TFLOP/s of three products a visible pair and head. dQ err: max abs difference from the tl kernel's "
             "dQ, relative to its largest magnitude.", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl `range_attn_bwd_dq_kernel` (compressed range only): {r['tl_ms']:.3f} ms, "
                  f"{r['tl_tflops']:.0f} TFLOP/s", "",
                  "| Gluon variant | ms | TFLOP/s | vs tl | dQ err |", "|---|---|---|---|---|"]
        for e in r["variants"]:
            if "error" in e:
                lines.append(f"| {_variant_name(e)} | {e['error']} | | | |")
            else:
                lines.append(f"| {_variant_name(e)} | {e['ms']:.3f} | {e['tflops']:.0f} | {e['vs_tl']:.3f} | "
                             f"{e['dq_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


def _variant_process(spec: dict) -> dict:
    """One variant at one shape in a process of its own: its dQ against the tl kernel's, then its time."""
    q, k, v, do, lse, delta, scale, tl_dq = _tl_setup(spec["family"], spec["B"], spec["T"])
    ref = tl_dq().float()
    entry = dict(spec["variant"])
    try:
        dq = compressed_dq_ws(q, k, v, do, lse, delta, scale, fill=float("nan"), **spec["variant"])
        torch.cuda.synchronize()
        entry["dq_err"] = float((dq.float() - ref).abs().max() / ref.abs().max())  # NaN if a row was missed
        ms = triton.testing.do_bench(lambda: compressed_dq_ws(q, k, v, do, lse, delta, scale, **spec["variant"]),
                                     warmup=20, rep=200)
        entry.update(ms=ms, tflops=spec["flops"] / ms / 1e9, vs_tl=spec["tl_ms"] / ms)
    except Exception as exc:  # a variant that does not compile or fit is a result of the spike
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return entry


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
        q, k, v, do, lse, delta, scale, tl_dq = _tl_setup(family, B, T)
        H, G, D = q.shape[2], k.shape[2], q.shape[3]
        triton.testing.do_bench(tl_dq, warmup=20, rep=200)  # clocks up
        t_ref = triton.testing.do_bench(tl_dq, warmup=20, rep=200)
        flops = compressed_flops(B, T, H, D) * 3 // 2  # three products where the forward has two
        row = dict(shape=f"{family}_{B}x{T}", B=B, T=T, H=H, G=G, D=D, tl_ms=t_ref, tl_tflops=flops / t_ref / 1e9,
                   variants=[])
        for index in args.variants:
            spec = dict(family=family, B=B, T=T, flops=flops, tl_ms=t_ref,
                        variant=dict(zip(VARIANT_FIELDS, VARIANTS[index])))
            entry = run_variant(__file__, spec, args.variant_timeout)
            row["variants"].append(entry)
            print(row["shape"], entry, flush=True)
        rows.append(row)
    stem, meta = result_stem(args.out, "gluon-compressed-dq", args.suffix, args.commit or git_commit())
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows))
    print(report(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
