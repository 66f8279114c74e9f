"""A spike: the compressed branch's dK/dV, warp-specialized as bench/gluon_compressed_fwd.py's forward, in Gluon,
against our Triton (tl) range dK/dV kernel on the compressed range alone, same run.

Why. kernels-notes v84: of the compressed backward at paper 64k, the dQ kernel runs its three products at 630
TFLOP/s and warp specialization did not beat it; the dK/dV kernel runs its four at about 490 (17.98 ms, v82). Its
two float32 accumulators (dK, dV) and the recomputed P crowd one warpgroup's registers (spills, v82-v83). Here
each of two consumer warpgroups owns 64 of a program's 128 keys, so each holds one half's accumulators, and a
loader partition streams the query tiles (q, dO) through a ring while the consumers compute.

Schedule of one program (128 compressed keys, HEADS heads of one group, one chunk of Q_CHUNK queries):
`compressed_dkdv_ws_kernel`. Step s is (head s // n, query tile s % n) over the chunk's n query tiles that see
the keys. The loader copies the program's K and V once, then step s's q and dO into slot s % STAGES once both
consumers have freed it. A consumer (64 keys), in its turn: S^T = K q^T, dP^T = V dO^T; then
P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - delta) (lse, delta per query: the columns), dV += P^T dO,
dK += dS^T q; it frees the slot when both products are done. At the end each adds its dK (times the scale) and dV
into float32 accumulators (programs of other chunks and heads add to the same rows).

Outcome on the H200 (bench/results/gluon-compressed-dkdv-h200-2026-12-03-v84{e,f}.md, kernels-notes.md v84): every
variant's dK and dV match the tl kernel's within 6e-3 of their largest magnitude (both add float32 partials, in
different orders). The best, one head a program on 64-query steps with 2 stages, ties tl: 1.01x at paper 64k (17.68
against 17.92 ms, 497 TFLOP/s against 491) and 32k, 0.95x at 8k. A third stage, 32-query steps (no spills,
0.87-0.91x) and several heads a program (0.83-0.99x, down to 0.18x at 8k, where few programs hold all the work) are
slower. Warp specialization does not lift the compressed dK/dV either; the file stays as the measurement.

Run on the GPU: PYTHONPATH=. python3 bench/gluon_compressed_dkdv.py --out DIR [--shapes paper:1:65536,...]
[--suffix=S] (checks each variant against the tl kernel's dK and dV, then times both; JSON and markdown).
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

from bench.gluon_compressed_fwd import (CMP_BLOCK, CMP_STRIDE, LOG2E, _desc, _inputs, compressed_flops, run_variant,
                                        spike_arguments)
from bench.provenance import git_commit, result_file, result_stem


@gluon.jit
def _first_query(key, key_stride, key_offset):
    """The first query that sees compressed token `key`."""
    return key * key_stride + key_offset


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_ring, do_ring, kv_bar, ready, empty, turn, LSE_T, DELTA_T, DK_ACC, DV_ACC,
                   b, g, key0, q_begin, n_q, T, num_keys, qk_scale, scale, key_stride, key_offset, head0,
                   CONSUMER: gl.constexpr, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                   KEYS: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, HEADS: gl.constexpr,
                   WARPS: gl.constexpr):
    """KEYS keys from key0: their dK, dV over the program's steps, added into the float32 accumulators."""
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, BLOCK_Q, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    keys_st: gl.constexpr = gl.SliceLayout(1, st_layout)
    queries_st: gl.constexpr = gl.SliceLayout(0, st_layout)
    FIRST: gl.constexpr = 1 if CONSUMER == 0 else 0

    offs_k = key0 + gl.arange(0, KEYS, layout=keys_st)
    first_q = _first_query(offs_k, key_stride, key_offset)  # per key: the first query that sees it
    # query tiles wholly past every key's first query need no mask
    full_from = _first_query(key0 + KEYS - 1, key_stride, key_offset)
    dk = gl.zeros([KEYS, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, D], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([KEYS, BLOCK_Q], gl.float32, layout=st_layout)
    n_steps = n_q * HEADS
    if n_steps > 0:
        mbarrier.wait(kv_bar, 0)
        for s in range(n_steps):
            slot = s % STAGES
            h = head0 + s // n_q
            t0 = q_begin + (s % n_q) * BLOCK_Q
            offs_q = t0 + gl.arange(0, BLOCK_Q, layout=queries_st)
            row = (b * H + h).to(gl.int64) * T + offs_q  # lse and delta laid out [B, H, T]
            lse2 = gl.load(LSE_T + row) * 1.4426950408889634
            lse2 = gl.where(lse2 == float("-inf"), 0.0, lse2)
            delta = gl.load(DELTA_T + row)
            mbarrier.wait(ready.index(slot), (s // STAGES) & 1)
            mbarrier.wait(turn.index(CONSUMER), (s & 1) ^ FIRST)
            st_tok = warpgroup_mma(k_smem, q_ring.index(slot).permute((1, 0)), st_zero, use_acc=False,
                                   is_async=True)
            dpt_tok = warpgroup_mma(v_smem, do_ring.index(slot).permute((1, 0)), st_zero, use_acc=False,
                                    is_async=True)
            mbarrier.arrive(turn.index(1 - CONSUMER), count=1)
            st, dpt = warpgroup_mma_wait(0, deps=(st_tok, dpt_tok))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            if t0 < full_from:
                pt = gl.where(gl.expand_dims(first_q, 1) <= gl.expand_dims(offs_q, 0), pt, 0.0)
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            pt_op = gl.convert_layout(pt.to(gl.bfloat16), op_layout)
            dst_op = gl.convert_layout(dst.to(gl.bfloat16), op_layout)
            dv_tok = warpgroup_mma(pt_op, do_ring.index(slot), dv, is_async=True)
            dk_tok = warpgroup_mma(dst_op, q_ring.index(slot), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok))
            mbarrier.arrive(empty.index(slot), count=1)
        rows_a: gl.constexpr = gl.SliceLayout(1, acc_layout)
        cols_a: gl.constexpr = gl.SliceLayout(0, acc_layout)
        offs_ka = key0 + gl.arange(0, KEYS, layout=rows_a)
        ptrs = (gl.expand_dims(((b * num_keys + offs_ka) * G + g).to(gl.int64) * D, 1)
                + gl.expand_dims(gl.arange(0, D, layout=cols_a), 0))
        ok = gl.expand_dims(offs_ka < num_keys, 1)  # the last tile's rows past the keys: another batch's, or zeros
        gl.atomic_add(DK_ACC + ptrs, dk * scale, mask=ok, sem="relaxed")
        gl.atomic_add(DV_ACC + ptrs, dv, mask=ok, sem="relaxed")


@gluon.jit
def _dkdv_loader(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring, do_ring, kv_bar, ready, empty, b, g,
                 key0, q_begin, n_q, T, head0, D: gl.constexpr, KEYS: gl.constexpr, BLOCK_Q: gl.constexpr,
                 STAGES: gl.constexpr, HEADS: gl.constexpr):
    """The program's K and V (two 64-key halves) once, then each step's q and dO tiles into the ring."""
    n_steps = n_q * HEADS
    if n_steps > 0:
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [key0 + i * KEYS, g * D], kv_bar, k_smem.index(i))
            tma.async_copy_global_to_shared(v_desc, [key0 + i * KEYS, g * D], kv_bar, v_smem.index(i))
        for s in range(n_steps):
            slot = s % STAGES
            h = head0 + s // n_q
            t0 = q_begin + (s % n_q) * BLOCK_Q
            mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b * T + t0, h * D], ready.index(slot), q_ring.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b * T + t0, h * D], ready.index(slot), do_ring.index(slot))


@gluon.jit
def compressed_dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, LSE_T, DELTA_T, DK_ACC, DV_ACC, T, num_keys,
                              qk_scale, scale, key_stride, key_offset, q_chunk, H: gl.constexpr, G: gl.constexpr,
                              D: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                              HEADS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    KEYS: gl.constexpr = BLOCK_K // 2
    gl.static_assert(KEYS == 16 * num_warps, "each consumer warp owns 16 keys")
    key_tile = gl.program_id(0)
    hg = gl.program_id(1)  # (batch, group, head block)
    blocks: gl.constexpr = H // G // HEADS
    b = hg // (G * blocks)
    g = (hg // blocks) % G
    head0 = g * (H // G) + (hg % blocks) * HEADS
    key0 = key_tile * BLOCK_K
    # the chunk's queries that see any of the program's keys, in whole tiles (T is a multiple of BLOCK_Q)
    chunk_begin = gl.program_id(2) * q_chunk
    chunk_end = gl.minimum(chunk_begin + q_chunk, T)
    q_begin = gl.maximum(chunk_begin, (_first_query(key0, key_stride, key_offset) // BLOCK_Q) * BLOCK_Q)
    n_q = gl.maximum(gl.cdiv(chunk_end - q_begin, BLOCK_Q), 0)

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, KEYS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, KEYS, D], v_desc.layout)
    q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_Q, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_Q, D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # each consumer frees a slot once
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_dkdv_consumer, (k_smem.index(0), v_smem.index(0), q_ring, do_ring, kv_bar, ready, empty, turn, LSE_T,
                          DELTA_T, DK_ACC, DV_ACC, b, g, key0, q_begin, n_q, T, num_keys, qk_scale, scale,
                          key_stride, key_offset, head0, 0, H, G, D, KEYS, BLOCK_Q, STAGES, HEADS, num_warps)),
        (_dkdv_consumer, (k_smem.index(1), v_smem.index(1), q_ring, do_ring, kv_bar, ready, empty, turn, LSE_T,
                          DELTA_T, DK_ACC, DV_ACC, b, g, key0 + KEYS, q_begin, n_q, T, num_keys, qk_scale, scale,
                          key_stride, key_offset, head0, 1, H, G, D, KEYS, BLOCK_Q, STAGES, HEADS, num_warps)),
        (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_ring, do_ring, kv_bar, ready, empty, b,
                        g, key0, q_begin, n_q, T, head0, D, KEYS, BLOCK_Q, STAGES, HEADS)),
    ], [num_warps, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


VARIANT_FIELDS = ("block_q", "stages", "heads", "q_chunk", "loader_warps", "loader_regs", "consumer_regs", "maxnreg")
VARIANTS = [  # VARIANT_FIELDS
    (64, 2, 1, 4096, 4, 24, 240, 168),
    (64, 3, 1, 4096, 4, 24, 240, 168),
    (64, 2, 4, 4096, 4, 24, 240, 168),
    (64, 2, 16, 4096, 4, 24, 240, 168),
    (64, 2, 16, 1024, 4, 24, 240, 168),
    (32, 2, 1, 4096, 4, 24, 240, 168),
    (32, 3, 1, 4096, 4, 24, 240, 168),
    (32, 4, 1, 4096, 4, 24, 240, 168),
]


def compressed_dkdv_ws(q, k, v, do, lse, delta, scale: float, cmp_block: int = CMP_BLOCK,
                       cmp_stride: int = CMP_STRIDE, block_q: int = 64, stages: int = 2, heads: int = 1,
                       q_chunk: int = 4096, loader_warps: int = 4, loader_regs: int = 24, consumer_regs: int = 240,
                       maxnreg: int = 168, block_k: int = 128):
    """(dk, dv) of the compressed branch in k's dtype: q, do [B, T, H, D]; compressed k and v [B, Tc, G, D], bf16,
    contiguous; lse and delta [B, T, H] float32. Float32 accumulators zeroed, the kernel, then the casts (as the tl
    path's atomic form)."""
    B, T, H, D = q.shape
    Tc, G = k.shape[1], k.shape[2]
    if T % block_q or q_chunk % block_q:
        raise ValueError(f"the spike needs T ({T}) and q_chunk ({q_chunk}) multiples of the query tile ({block_q})")
    if D not in (64, 128) or H % G or (H // G) % heads:
        raise ValueError(f"the spike takes head dim 64 or 128 and heads dividing a group's; got D={D}, H={H}, "
                         f"G={G}, heads={heads}")
    lse_t, delta_t = lse.permute(0, 2, 1).contiguous(), delta.permute(0, 2, 1).contiguous()
    dk_acc = torch.zeros(B, Tc, G, D, device=q.device, dtype=torch.float32)
    dv_acc = torch.zeros_like(dk_acc)
    grid = (triton.cdiv(Tc, block_k), B * G * (H // G // heads), triton.cdiv(T, q_chunk))
    compressed_dkdv_ws_kernel[grid](
        _desc(q.view(B * T, H * D), [block_q, D]), _desc(do.view(B * T, H * D), [block_q, D]),
        _desc(k.reshape(B * Tc, G * D), [block_k // 2, D]), _desc(v.reshape(B * Tc, G * D), [block_k // 2, D]),
        lse_t, delta_t, dk_acc, dv_acc, T, Tc, scale * LOG2E, scale, cmp_stride, cmp_block - 1, q_chunk, H=H, G=G,
        D=D, BLOCK_K=block_k, BLOCK_Q=block_q, STAGES=stages, HEADS=heads, LOADER_WARPS=loader_warps,
        LOADER_REGS=loader_regs, CONSUMER_REGS=consumer_regs, num_warps=block_k // 32, maxnreg=maxnreg)
    return dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _tl_setup(family: str, B: int, T: int):
    """The inputs, the tl forward's lse, a random dO, delta, and a function running the tl dK/dV kernel on the
    compressed range alone (as nsa::core's backward launches it, with its float32 accumulators and casts)."""
    from nsa_model.ops import triton_impl as ti
    q, k, v, scale = _inputs(family, B, T)
    cmp = ti._cmp_range(CMP_BLOCK, CMP_STRIDE, T)
    o, lse = ti._range_fwd(q, k, v, *cmp, scale)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
    delta = ti._delta(do, o)

    def tl_dkdv():
        return ti._range_dkdv(q, k, v, do, lse, delta, *cmp, scale)
    return q, k, v, do, lse, delta, scale, tl_dkdv


def _variant_name(e: dict) -> str:
    return (f"128 keys x {e['block_q']} queries, {e['stages']} stages, {e['heads']} heads a program, chunks of "
            f"{e['q_chunk']}, 2 x 4 warps, turns, maxnreg {e['maxnreg']}")


def report(meta: dict, rows: list[dict]) -> str:
    """Markdown: the tl kernel, then each Gluon variant as time, FLOP rate, ratio to tl and errors against tl."""
    lines = [f"# Compressed-branch dK/dV, warp-specialized Gluon against the tl kernel: {meta['device']}, "
             f"{meta['date'][:16]}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, l = {CMP_BLOCK}, "
             f"d = {CMP_STRIDE}, bf16, median of triton.testing.do_bench, each side with its float32 accumulators' "
             "zero fill and casts. vs tl > 1: the Gluon kernel is faster. TFLOP/s of four products a visible pair "
             "and head. Errors: max abs difference from the tl kernel's dK and dV, relative to its largest "
             "magnitude.", ""]
    for r in rows:
        lines += [f"## {r['shape']} (B={r['B']}, T={r['T']}, H={r['H']}, G={r['G']}, D={r['D']})", "",
                  f"tl `range_attn_bwd_dkdv_kernel` (compressed range only): {r['tl_ms']:.3f} ms, "
                  f"{r['tl_tflops']:.0f} TFLOP/s", "",
                  "| Gluon variant | ms | TFLOP/s | vs tl | dK err | dV err |", "|---|---|---|---|---|---|"]
        for e in r["variants"]:
            if "error" in e:
                lines.append(f"| {_variant_name(e)} | {e['error']} | | | | |")
            else:
                lines.append(f"| {_variant_name(e)} | {e['ms']:.3f} | {e['tflops']:.0f} | {e['vs_tl']:.3f} | "
                             f"{e['dk_err']:.2g} | {e['dv_err']:.2g} |")
        lines.append("")
    return "\n".join(lines)


def _variant_process(spec: dict) -> dict:
    """One variant at one shape in a process of its own: its dK, dV against the tl kernel's, then its time."""
    q, k, v, do, lse, delta, scale, tl_dkdv = _tl_setup(spec["family"], spec["B"], spec["T"])
    dk_ref, dv_ref = (x.float() for x in tl_dkdv())
    entry = dict(spec["variant"])
    try:
        dk, dv = compressed_dkdv_ws(q, k, v, do, lse, delta, scale, **spec["variant"])
        torch.cuda.synchronize()
        entry["dk_err"] = float((dk.float() - dk_ref).abs().max() / dk_ref.abs().max())
        entry["dv_err"] = float((dv.float() - dv_ref).abs().max() / dv_ref.abs().max())
        ms = triton.testing.do_bench(lambda: compressed_dkdv_ws(q, k, v, do, lse, delta, scale, **spec["variant"]),
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
        q, k, v, do, lse, delta, scale, tl_dkdv = _tl_setup(family, B, T)
        H, G, D = q.shape[2], k.shape[2], q.shape[3]
        triton.testing.do_bench(tl_dkdv, warmup=10, rep=100)  # clocks up
        t_ref = triton.testing.do_bench(tl_dkdv, warmup=10, rep=100)
        flops = compressed_flops(B, T, H, D) * 2  # four products where the forward has two
        row = dict(shape=f"{family}_{B}x{T}", B=B, T=T, H=H, G=G, D=D, tl_ms=t_ref, tl_tflops=flops / t_ref / 1e9,
                   variants=[])
        for index in args.variants:
            spec = dict(family=family, B=B, T=T, flops=flops, tl_ms=t_ref,
                        variant=dict(zip(VARIANT_FIELDS, VARIANTS[index])))
            entry = run_variant(__file__, spec, args.variant_timeout)
            row["variants"].append(entry)
            print(row["shape"], entry, flush=True)
        rows.append(row)
    stem, meta = result_stem(args.out, "gluon-compressed-dkdv", args.suffix, args.commit or git_commit())
    result_file(stem, ".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    result_file(stem, ".md").write_text(report(meta, rows))
    print(report(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
