"""Hardware counters of the NSA core's kernels: one NSA forward + backward run under Nsight Compute, and a table.

    ncu --clock-control none --profile-from-start off --kernel-name regex:'select|range_attn|gated_sum' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats \\
        -o report python3 bench/kernel_counters.py --shape 125m:4:8192
    ncu --import report.ncu-rep --page raw --csv > report.csv
    python3 bench/kernel_counters.py --table report.csv > counters.md

The table reads metrics of those sections; one that a report lacks shows as "-". The warm-up calls (Triton's
compiles, the first launches) run before the profiler starts, so the report holds the kernels of exactly one
call. bench/kernels.py times that call; the counters say why a kernel takes its time: how busy the matrix units
and DRAM are, how many warps each multiprocessor holds and what stalls them (kernels-notes.md, v22).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.launch import launch_overrides  # noqa: E402
from bench.shapes import family_shapes  # noqa: E402

# (column, ncu metric, scale to the shown unit or None for a count/percent)
COLUMNS = [
    ("us", "gpu__time_duration.sum", {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                                        "msecond": 1e3}),
    ("matrix units busy %", "sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active."
                            "avg.pct_of_peak_sustained_elapsed", None),
    ("issue slots busy %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", None),
    ("DRAM % of peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", None),
    # what bounds a kernel that rereads tiles other programs also read (the per-query selected kernels): the L2's
    # own throughput, and the L1/shared-memory unit's, each against its peak
    ("L2 % of peak", "lts__throughput.avg.pct_of_peak_sustained_elapsed", None),
    ("L1 % of peak", "l1tex__throughput.avg.pct_of_peak_sustained_active", None),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", None),
    ("registers / thread", "launch__registers_per_thread", None),
    ("warps / SM", "sm__warps_active.avg.per_cycle_active", None),
    ("programs / SM by registers", "launch__occupancy_limit_registers", None),
    ("by shared memory", "launch__occupancy_limit_shared_mem", None),
    ("spill instructions", "sass__inst_executed_register_spilling", None),
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def table(path: str) -> list[str]:
    """Markdown rows, one per kernel launch of an `ncu --page raw --csv` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_at = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if head_at is None:
        raise SystemExit(f"{path}: not an ncu raw CSV export (no 'ID' header row)")
    head, units, data = rows[head_at], rows[head_at + 1], rows[head_at + 2:]
    col = {h: i for i, h in enumerate(head)}
    stalls = [h for h in head if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX)]
    out = ["| kernel | " + " | ".join(c for c, _, _ in COLUMNS) + " | top stalls (warps per issue) |",
           "|---" * (len(COLUMNS) + 2) + "|"]
    for r in data:
        cells = []
        for _, metric, scales in COLUMNS:
            value = _number(r[col[metric]]) if metric in col else None
            if value is not None and scales:
                unit = units[col[metric]]
                if unit not in scales:
                    raise SystemExit(f"{path}: {metric} in unit {unit!r}, not one of {sorted(scales)}")
                value *= scales[unit]
            cells.append("-" if value is None else f"{value:.4g}")
        ranked = sorted(((_number(r[col[h]]) or 0.0, h[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for h in stalls),
                        reverse=True)[:4]
        name = r[col["Kernel Name"]].split("(")[0]
        out.append(f"| `{name}` | " + " | ".join(cells) + " | " + ", ".join(f"{n} {v:.2f}" for v, n in ranked)
                   + " |")
    return out


def profiled_call(shape: str, launch: list[str], warmup: int) -> None:
    import torch

    from bench.kernels import PAPER_NSA, SHAPES, make_inputs
    from nsa_model.ops import triton_impl as ti

    if not torch.cuda.is_available():
        raise SystemExit("bench/kernel_counters.py needs a CUDA GPU to profile (--table does not)")
    shapes = family_shapes(shape, SHAPES)
    if len(shapes) != 1:
        raise SystemExit(f"--shape: one family:B:T, got {shape!r}")
    (family, B, T), = shapes
    overrides = launch_overrides(launch)
    if overrides:
        ti.set_launch_config(dataclasses.replace(ti.launch_config(), **overrides))
    s = SHAPES[family]
    x = make_inputs(B, T, s["H"], s["G"], s["Dk"], s["Dv"], PAPER_NSA, torch.bfloat16, seed=1)
    leaves = [t.requires_grad_() for t in x.values()]
    do = torch.randn(B, T, s["H"], s["Dv"], device="cuda", dtype=torch.bfloat16)

    def fwd_bwd() -> None:
        ti.nsa_attention(*leaves, PAPER_NSA, scale=s["Dk"] ** -0.5).backward(do)
        for t in leaves:
            t.grad = None

    for _ in range(warmup):
        fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one NSA forward + backward at {family} {B} x {T}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="125m:4:8192", help="family:B:T (bench/kernels.py's SHAPES)")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                    help="a LaunchConfig field to change for this run (repeatable)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--table", nargs="+", metavar="CSV", help="print a markdown table of these ncu raw CSV exports")
    args = ap.parse_args()
    if args.table:
        for path in args.table:
            print("\n".join([f"`{os.path.basename(path)}`:", ""] + table(path) + [""]))
        return
    profiled_call(args.shape, args.launch, args.warmup)


if __name__ == "__main__":
    main()
