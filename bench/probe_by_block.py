"""Probe (timing only, not a check) of where by_block's time goes: what its gathers and its per-slot partials cost
(kernels-notes.md v33).

    python bench/probe_by_block.py --out DIR [--commit SHA] [--suffix=-v33c] [--chunks 128,64]

Variants of kernels/selected_by_block.py built by editing its source (their results are wrong by construction;
only their times matter), each timed on NSA's own selections of random inputs at the 125M shapes, by_block forced,
as CUDA graphs (do_bench_cudagraph medians):

- forward (`_selected_by_block_fwd`: the block kernel and the combine pass) and the combine pass alone;
- the forward with each partial output row stored as 4 bytes instead of 128 (what the block kernel would take if
  the partials never left the chip); stored whole, but each program's rows into 64 rows of a 4 MB window (about
  the same instructions and registers, no DRAM traffic: which of the two the stores cost); stored whole at their
  entries' places in the sorted order (each program's rows one contiguous run); into the 4 MB window by TMA
  stores (the tile through shared memory and the copy engine); with the query rows
  loaded contiguously instead of gathered; and the first and third together;
- the backward (`_selected_by_block_bwd` with dQ slots, not summed) and the same with each dQ slot row stored as 4
  bytes, into a 4 MB window or in the sorted order, and the slot sum's read of them alone (`selected_dq_sum_kernel`);
- the forward's partials and the backward's dQ slots stored without their L2 eviction hint (evict_first), as
  before v43 (right results);
- the forward with every step in its masked loop (right results): what its second, unmasked loop saves (v44);
- the forward and the backward as they are with shorter programs (slc_block_chunk, choosers per program: --chunks),
  what a work list of short items costs by itself.

Writes probe-<device>-<date><suffix>.json and .md.
"""

import argparse
import dataclasses
import pathlib

import torch
import triton
from triton.testing import do_bench_cudagraph

from bench.kernel_variants import edited_module, selection_inputs, write_times
from bench.provenance import file_suffix, git_commit
from nsa_model.ops import triton_impl as ti

SHAPES = {"125m 4x8k": (4, 8192), "125m 16x2k": (16, 2048), "125m 1x32k": (1, 32768)}  # H = 12, G = 2, D = 64
O_STORE = ("tl.store(O_PART + row_p[:, None] * DV + offs_dv[None, :],\n"
           "                         (acc * (1.0 / l_safe)[:, None]).to(O_PART.dtype.element_ty),\n"
           "                         mask=r_ok[:, None] & (offs_dv < DV)[None, :], eviction_policy=\"evict_first\")")
O_STORE_4B = "tl.store(LSE2_PART + row_p, tl.sum(acc, axis=1) / l_safe, mask=r_ok)"
# each program's rows into 64 rows of its own in a 4 MB window (512 windows): the same instructions and about the
# same registers, but no DRAM traffic
WINDOW = "(row_p % 64 + (tl.program_id(0) % 512) * 64)"
O_STORE_L2 = O_STORE.replace("O_PART + row_p[:, None]", f"O_PART + {WINDOW}[:, None]")
Q_GATHER = ("q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=r_ok[:, None] & (offs_dk < DK)[None, :], "
            "other=0.0)")
Q_CONTIGUOUS = ("q = tl.load(Q + (b * T * H + tl.arange(0, ROWS)).to(tl.int64)[:, None] * DK + offs_dk[None, :], "
                "mask=r_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)")
DQ_STORE = ("tl.store(DQ_OUT + row_p[:, None] * DK + offs_dk[None, :], dq.to(DQ_OUT.dtype.element_ty), "
            "mask=q_ok,\n                         eviction_policy=\"evict_first\")")
DQ_STORE_4B = "tl.store(DQ_OUT + row_p * DK, tl.sum(dq, axis=1).to(DQ_OUT.dtype.element_ty), mask=r_ok)"
DQ_STORE_L2 = DQ_STORE.replace("DQ_OUT + row_p[:, None]", f"DQ_OUT + {WINDOW}[:, None]")
# each step's rows at its entries' places in the sorted order (entry e's head rows at e * HPG ..): every program
# writes one contiguous run, the whole kernel one sequential stream (the combine would then need each slot's place)
WORK_ORDER = "(e0 * HPG + tl.arange(0, ROWS)).to(tl.int64)"
O_STORE_ORDERED = O_STORE.replace("O_PART + row_p[:, None]", f"O_PART + {WORK_ORDER}[:, None]")
DQ_STORE_ORDERED = DQ_STORE.replace("DQ_OUT + row_p[:, None]", f"DQ_OUT + {WORK_ORDER}[:, None]")
# each program's rows into the same 4 MB window by a TMA store (a tensor descriptor made in the kernel; the
# probe sets Triton's allocator for it): the tile goes to shared memory and the copy engine writes it, where the
# pointer store converts it through shared memory and writes it from registers
FWD_LOOP = ("        split = _masked_steps_end(first, start, end, SEL_BLOCK, BLOCK_S, ENTRIES)\n"
            "        for PHASE in tl.static_range(2):  # 0: the block's own")
O_DESC = ("        o_desc = tl.make_tensor_descriptor(O_PART, shape=[32768, DV], strides=[DV, 1], "
          "block_shape=[ROWS, BLOCK_DV])\n")
O_STORE_TMA = ("o_desc.store([(tl.program_id(0) % 512) * ROWS, 0], "
               "(acc * (1.0 / l_safe)[:, None]).to(O_PART.dtype.element_ty))")
# as before v43: the partials and dQ slots stored without the L2 eviction hint evict_first (they stream through L2
# once). v43's candidates that lost (kernels-notes.md): streaming stores (.cs) for the partials, the gathered query
# and do rows loaded evict_last, the combine's partial reads evict_first.
HINT = ', eviction_policy="evict_first"'
LSE2_STORE = 'tl.store(LSE2_PART + row_p, lse2, mask=r_ok, eviction_policy="evict_first")'
PARTIALS_NO_HINT = [(O_STORE, O_STORE.replace(HINT, "")), (LSE2_STORE, LSE2_STORE.replace(HINT, ""))]
DQ_NO_HINT = [(DQ_STORE, DQ_STORE.replace(',\n                         eviction_policy="evict_first"', ""))]
# every step of the forward through its first, masked loop (right results): the visibility mask's compares and
# selects on every step (before v44 the forward checked each step for choosers inside the block and masked those)
EVERY_STEP_MASKED = [("        split = _masked_steps_end(first, start, end, SEL_BLOCK, BLOCK_S, ENTRIES)\n",
                      "        split = end\n")]
FORWARD_EDITS = {"prod": [], "o partial 4 B a row": [(O_STORE, O_STORE_4B)],
                 "o partial rows into a 4 MB window": [(O_STORE, O_STORE_L2)],
                 "o partial rows in work order": [(O_STORE, O_STORE_ORDERED)],
                 "o partial rows into a 4 MB window by TMA": [(FWD_LOOP, O_DESC + FWD_LOOP), (O_STORE, O_STORE_TMA)],
                 "q rows contiguous": [(Q_GATHER, Q_CONTIGUOUS)],
                 "both": [(O_STORE, O_STORE_4B), (Q_GATHER, Q_CONTIGUOUS)],
                 "partials without the eviction hint (before v43)": PARTIALS_NO_HINT,
                 "every step masked (before v44)": EVERY_STEP_MASKED}
BACKWARD_EDITS = {"prod": [], "dQ slot 4 B a row": [(DQ_STORE, DQ_STORE_4B)],
                  "dQ slot rows into a 4 MB window": [(DQ_STORE, DQ_STORE_L2)],
                  "dQ slot rows in work order": [(DQ_STORE, DQ_STORE_ORDERED)],
                  "dQ slots without the eviction hint (before v43)": DQ_NO_HINT}


def variant(name: str, edits):
    """The by_block module with `edits` applied (None where an edit's text is not in the source)."""
    return edited_module("selected_by_block.py", name, edits)


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=200) * 1000  # us


def probe(B: int, T: int, chunks: list[int]) -> dict:
    cfg, q, k, v, do, blocks, scale = selection_inputs(B, T, H=12, G=2, D=64)
    H, G, n = q.shape[2], k.shape[2], blocks.shape[-1]
    common = dict(H=H, G=G, SEL_BLOCK=cfg.sel_block, BLOCK_S=cfg.sel_block, N_SELECT=n, **ti._head_dims(q, v),
                  **ti._kv_strides(k, v))
    index = ti._by_block_index(blocks, cfg.sel_block, ti.launch_config())
    o, lse, _, _ = ti._selected_fwd(q, k, v, blocks, cfg.sel_block, scale)
    delta = ti._delta(do, o)
    row = {}
    prod_fwd, prod_bwd = ti.selected_block_fwd_kernel, ti.selected_block_bwd_kernel
    try:
        for name, edits in FORWARD_EDITS.items():
            ti.selected_block_fwd_kernel = variant(name, edits).selected_block_fwd_kernel
            row[f"forward: {name}"] = bench(lambda: ti._selected_by_block_fwd(q, k, v, blocks, o, lse, index, common,
                                                                              scale))
        ti.selected_block_fwd_kernel = prod_fwd
        slots = B * T * G * n * (H // G)
        o_part = torch.randn(slots, v.shape[-1], device="cuda").bfloat16()
        lse_part = torch.randn(slots, device="cuda")
        rows = B * T * H
        row["combine pass alone"] = bench(lambda: ti.selected_combine_kernel[(triton.cdiv(rows, ti._COMBINE_ROWS),)](
            o_part, lse_part, blocks, o, lse, rows, H=H, G=G, DV=v.shape[-1], BLOCK_DV=common["BLOCK_DV"],
            N_SELECT=n, BLOCK_R=ti._COMBINE_ROWS))
        for name, edits in BACKWARD_EDITS.items():
            ti.selected_block_bwd_kernel = variant(name, edits).selected_block_bwd_kernel
            row[f"backward, dQ slots: {name}"] = bench(lambda: ti._selected_by_block_bwd(
                q, k, v, blocks, do, lse, delta, index, common, scale, dq_slots=True))
        dq = torch.empty_like(q)
        row["dQ slot sum alone"] = bench(lambda: ti.selected_dq_sum_kernel[(triton.cdiv(rows, ti._COMBINE_ROWS),)](
            o_part, blocks, dq, dq, dq, rows, H=H, G=G, DK=q.shape[-1], BLOCK_DK=common["BLOCK_DK"], N_SELECT=n,
            BLOCK_R=ti._COMBINE_ROWS, NUM_ADD=0))
    finally:
        ti.selected_block_fwd_kernel, ti.selected_block_bwd_kernel = prod_fwd, prod_bwd
    for chunk in chunks:
        with ti.use_launch_config(dataclasses.replace(ti.launch_config(), slc_block_chunk=chunk)):
            short = ti._by_block_index(blocks, cfg.sel_block, ti.launch_config())
            row[f"forward: {chunk} choosers a program"] = bench(lambda: ti._selected_by_block_fwd(
                q, k, v, blocks, o, lse, short, common, scale))
            row[f"backward: {chunk} choosers a program"] = bench(lambda: ti._selected_by_block_bwd(
                q, k, v, blocks, do, lse, delta, short, common, scale, dq_slots=True))
    return row


def write(out_dir: pathlib.Path, suffix: str, commit: str, results: dict) -> pathlib.Path:
    return write_times(out_dir, suffix, commit, results, title="where by_block's time goes", unit="us", fmt=".1f",
                       note="`bench/probe_by_block.py`: by_block forced, NSA's own selections of random inputs, "
                       "`do_bench_cudagraph` medians in microseconds per call. The edited variants give wrong "
                       "results; only their times matter (the module docstring says what each leaves out).")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--suffix", type=file_suffix, default="-by-block")
    parser.add_argument("--chunks", default="", help="comma-separated slc_block_chunk values to time besides the "
                        "default's")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c]
    # the TMA-store variant makes its tensor descriptor in the kernel, which needs a global scratch allocator
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = {}
    for shape, (B, T) in SHAPES.items():
        results[shape] = probe(B, T, chunks)
        print(shape, {k: round(v, 1) for k, v in results[shape].items()}, "us", flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(write(out_dir, args.suffix, args.commit or git_commit(), results))


if __name__ == "__main__":
    main()
