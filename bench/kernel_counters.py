"""Hardware counters of the NSA core's kernels: one NSA forward + backward, run under Nsight Compute.

    ncu --clock-control none --profile-from-start off --kernel-name regex:'selected|range_attn' \
        --section SpeedOfLight --section WarpStateStats -o report python3 bench/kernel_counters.py --shape 125m:4:8192

The warm-up calls (Triton's compiles, the first launches) run before the profiler starts, so the report holds the
kernels of exactly one call. bench/kernels.py times the same call; this says why a kernel takes its time (its
DRAM and L2 traffic, its stall reasons), which timings alone cannot (kernels-notes.md, v22).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.kernels import PAPER_NSA, SHAPES, make_inputs  # noqa: E402
from bench.launch import launch_overrides  # noqa: E402
from nsa_model.ops import triton_impl as ti  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="125m:4:8192", help="family:B:T, family one of " + ", ".join(SHAPES))
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                    help="a LaunchConfig field to change for this run (repeatable)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_counters.py needs a CUDA GPU")
    family, B, T = args.shape.split(":")
    if family not in SHAPES:
        raise SystemExit(f"--shape: family must be one of {list(SHAPES)}, got {family!r}")
    overrides = launch_overrides(args.launch)
    if overrides:
        ti.set_launch_config(dataclasses.replace(ti.launch_config(), **overrides))
    s = SHAPES[family]
    B, T = int(B), int(T)
    x = make_inputs(B, T, s["H"], s["G"], s["Dk"], s["Dv"], PAPER_NSA, torch.bfloat16, seed=1)
    leaves = [t.requires_grad_() for t in x.values()]
    do = torch.randn(B, T, s["H"], s["Dv"], device="cuda", dtype=torch.bfloat16)

    def fwd_bwd() -> None:
        ti.nsa_attention(*leaves, PAPER_NSA, scale=s["Dk"] ** -0.5).backward(do)
        for t in leaves:
            t.grad = None

    for _ in range(args.warmup):
        fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one NSA forward + backward at {family} {B} x {T}", flush=True)


if __name__ == "__main__":
    main()
