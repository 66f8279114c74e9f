"""Probe: by_block's inverted index built both ways (LaunchConfig.index_build), checked against each other and
timed as CUDA graphs, on NSA's own selections of random inputs.

    python bench/probe_index.py [--shapes 125m:16:2048,125m:4:8192,125m:1:32768,paper:1:8192,paper:1:65536]
                                --out DIR --commit SHA [--suffix=-v47a]

"sort" is PyTorch's stable radix sort of every slot's segment key plus three small kernels (segment ids, starts,
work list); "count" is three kernels (per-tile histograms, prefix sums, in-register sorts of each tile;
kernels/block_index.py). Inside the training step the index is built in a CUDA graph, where the host's launch
work is gone, so both are timed as graph replays (triton.testing.do_bench_cudagraph, median). Before timing, the
two builds must give the same segment starts and the same order of every valid slot, or the probe stops. Writes
DIR/probe-<device>-<date><suffix>.json and .md (microseconds a build).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit  # noqa: E402
from bench.shapes import FAMILIES, ISSUE4_SHAPES, family_shapes  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=family_shapes, default=ISSUE4_SHAPES)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch
    import triton
    import triton.testing

    from bench.kernel_variants import selection_inputs, write_times
    from nsa_model.ops import triton_impl as ti

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_index.py needs a CUDA GPU")
    chunk = ti.launch_config().slc_block_chunk
    builds = ("count", "sort")
    results = {build: {} for build in builds}
    for family, B, T in args.shapes:
        f = FAMILIES[family]
        cfg, *_, blocks, _ = selection_inputs(B, T, f["H"], f["G"], f["D"])
        num_blocks = triton.cdiv(T, cfg.sel_block)
        built = {b: ti.block_work(blocks, num_blocks, chunk, build=b) for b in builds}
        valid = int((blocks >= 0).sum())
        (order_c, starts_c, *_), (order_s, starts_s, *_) = built["count"], built["sort"]
        if not (torch.equal(starts_c, starts_s) and torch.equal(order_c[:valid], order_s[:valid])):
            raise SystemExit(f"{family} {B} x {T}: the count and sort builds disagree")
        name = f"{family} {B} x {T}"
        for build in builds:
            ms = triton.testing.do_bench_cudagraph(lambda: ti.block_work(blocks, num_blocks, chunk, build=build),
                                                   return_mode="median")
            results[build][name] = 1000 * ms
            print(f"{name}: {build} {1000 * ms:.1f} us", flush=True)
    stem = write_times(args.out, args.suffix, args.commit or git_commit(), results,
                       title="by_block's inverted index, two builds", unit="us", fmt=".1f",
                       note="CUDA graph replays (do_bench_cudagraph, median), microseconds a build, NSA's own "
                            "selections of random bf16 inputs (bench/kernel_variants.selection_inputs); the two "
                            "builds checked equal first.")
    print(stem)


if __name__ == "__main__":
    main()
