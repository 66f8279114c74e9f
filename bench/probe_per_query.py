"""Probe (timing only, not a check) of the per-query selected kernels at the paper's long shapes, where they run:
what L2 eviction hints on their streaming rows give (kernels-notes.md v43).

    python bench/probe_per_query.py --out DIR [--commit SHA] [--suffix=-v43x] [--seq-lens 32768,65536]

One program per (query, kv group) reads its query rows (and in the dQ kernel its do rows and the dQ it adds to)
once and writes its output once, while the group's selected key and value blocks, read by every query that chose
them, stay in L2 from one program to the next (the grid runs one group's queries together: at T = 64k a group's
K and V are 33.5 MB of the H100's 50 MB of L2). The variants of kernels/selected_attention.py, built by editing
its source, load and store those streaming rows with eviction_policy="evict_first", so they leave L2 first:
- the forward (`selected_attn_fwd_kernel`): q loaded, o and lse stored;
- the dQ kernel (`selected_attn_bwd_dq_kernel`): q and do loaded, dQ loaded (ACCUMULATE) and stored.

Each is timed alone on NSA's own selections of random inputs at the paper configuration (H = 64, G = 4, D = 128),
as CUDA graphs (do_bench_cudagraph medians, ms). Writes probe-<device>-<date><suffix>.json and .md.
"""

import argparse
import pathlib

import torch
from triton.testing import do_bench_cudagraph

from bench.kernel_variants import edited_module, selection_inputs, write_times
from bench.provenance import file_suffix, git_commit
from nsa_model.ops import triton_impl as ti

HINT = ', eviction_policy="evict_first")'
Q_LOAD = ("q = tl.load(Q + row_q[:, None] * DK + offs_dk[None, :], mask=h_ok[:, None] & (offs_dk < DK)[None, :], "
          "other=0.0)")
O_STORE = "tl.store(O + at, o, mask=ok)"
LSE_STORE = "tl.store(LSE + row_q, lse, mask=h_ok)"
DO_LOAD = ("do = tl.load(DO + row_q[:, None] * DV + offs_dv[None, :], mask=h_ok[:, None] & (offs_dv < DV)[None, :],\n"
           "                 other=0.0)")
DQ_IN = "dq_in = tl.load(dq_ptrs, mask=dq_ok, other=0.0)"
DQ_STORE = "tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=dq_ok)"
STREAMS_EVICT_FIRST = [(text, text[:-1] + HINT) for text in (Q_LOAD, O_STORE, LSE_STORE, DO_LOAD, DQ_IN, DQ_STORE)]
VARIANTS = {"prod": [], "streaming rows evict_first": STREAMS_EVICT_FIRST}


def variant(name: str, edits):
    """The selected-attention module with `edits` applied (None where an edit's text is not in the source)."""
    return edited_module("selected_attention.py", name, edits)


def probe(T: int) -> dict:
    cfg, q, k, v, do, blocks, scale = selection_inputs(1, T, H=64, G=4, D=128)
    H, G, n = q.shape[2], k.shape[2], blocks.shape[-1]
    kernel = ti.selected_kernel(H // G, -(-T // cfg.sel_block), n)
    if kernel != "per_query":
        raise SystemExit(f"T = {T}: the selected branch runs {kernel!r} here, not per_query")
    o, lse, _, _ = ti._selected_fwd(q, k, v, blocks, cfg.sel_block, scale)
    delta = ti._delta(do, o)
    common = ti._selected_common(q, k, v, cfg.sel_block, n)
    extra = dict(HEADS_PAD=ti._pow2(H // G), **common, **ti._slc_launch(), **ti._block_tiles(ti._pow2(H // G), common,
                                                                                            k, v))
    dq = torch.empty_like(q)
    row = {}
    for name, edits in VARIANTS.items():
        module = variant(name, edits)
        fwd, bwd_dq = module.selected_attn_fwd_kernel, module.selected_attn_bwd_dq_kernel
        row[f"forward: {name}"] = do_bench_cudagraph(lambda: fwd[(T, G)](
            q, k, v, BLOCKS=blocks, O=o, LSE=lse, T=T, scale=scale, **extra), rep=500)
        row[f"dQ, adding into another dQ: {name}"] = do_bench_cudagraph(lambda: bwd_dq[(T, G)](
            q, k, v, BLOCKS=blocks, DO=do, LSE=lse, DELTA=delta, DQ=dq, T=T, scale=scale, ACCUMULATE=True,
            **extra), rep=500)
    return row


def write(out_dir: pathlib.Path, suffix: str, commit: str, results: dict) -> pathlib.Path:
    return write_times(out_dir, suffix, commit, results, title="the per-query selected kernels' streaming rows",
                       unit="ms", fmt=".3f", column=lambda T: f"T = {T}",
                       note="`bench/probe_per_query.py`: paper configuration (H = 64, G = 4, D = 128), batch 1, "
                       "NSA's own selections of random inputs, `do_bench_cudagraph` medians in milliseconds per call.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--suffix", type=file_suffix, default="-per-query")
    parser.add_argument("--seq-lens", default="65536", help="comma-separated T values (per_query runs from 16n + 1 "
                        "blocks on)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_per_query.py needs a CUDA GPU")
    results = {}
    for T in (int(t) for t in args.seq_lens.split(",")):
        results[T] = probe(T)
        print(T, {k: round(v, 3) for k, v in results[T].items()}, "ms", flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(write(out_dir, args.suffix, args.commit or git_commit(), results))


if __name__ == "__main__":
    main()
