"""Hardware counters of the NSA core's kernels: one NSA forward + backward run under Nsight Compute, and a table.

    ncu --clock-control none --profile-from-start off --kernel-name regex:'select|range_attn|gated_sum' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats \\
        -o report python3 bench/kernel_counters.py --shape 125m:4:8192
    ncu --import report.ncu-rep --page raw --csv > report.csv
    python3 bench/kernel_counters.py --table report.csv > counters.md

Where in a kernel's code its warps wait (add --section SourceCounters to the profile):

    ncu --import report.ncu-rep --page source --csv --print-source sass > source.csv
    python3 bench/kernel_counters.py --stalls source.csv > stalls.md

The second table ranks each launch's SASS instructions by the warp stall samples taken on them, with each one's
main stall reasons: a wait on a load shows as its branch after the barrier's try-wait (long scoreboard), a wait
on the matrix units as WARPGROUP.DEPBAR, a register operand still in flight from shared memory as
WARPGROUP.ARRIVE (short scoreboard) (kernels-notes.md, v85).

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
import re
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


SAMPLES = "Warp Stall Sampling (All Samples)"


def _source_launches(path: str) -> list[tuple[str, list[dict]]]:
    """(kernel name, rows) of each launch in an `ncu --page source --csv --print-source sass` export: a
    "Kernel Name" line, a header, then one row per SASS instruction."""
    launches: list[tuple[str, list[dict]]] = []
    header = None
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                launches.append((rec[1], []))
                header = None
            elif not launches:
                raise SystemExit(f"{path}: not an ncu source CSV export (no 'Kernel Name' line first)")
            elif header is None:
                header = rec
                if SAMPLES not in header or "Source" not in header:
                    raise SystemExit(f"{path}: the source page lacks {SAMPLES!r} (profile with SourceCounters)")
            else:
                launches[-1][1].append(dict(zip(header, rec)))
    return launches


def _opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: '@!P0 BRA 0x..' -> 'BRA'."""
    words = source.split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words[0].split(".")[0] if words else "?"


def _predicate_setter(rows: list[dict], j: int, lookback: int = 32) -> str | None:
    """The opcode (with modifiers) of the nearest instruction before rows[j] that writes the predicate rows[j]
    branches on: '@!P0 BRA ..' after 'SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], RZ' gives the latter's opcode."""
    m = re.match(r"@!?(U?P\d)\s", rows[j]["Source"].strip())
    if not m:
        return None
    for r in reversed(rows[max(0, j - lookback):j]):
        words = r["Source"].split()
        words = words[1:] if words and words[0].startswith("@") else words
        if len(words) > 1 and words[1].rstrip(",") == m.group(1):
            return words[0]
    return None


def stall_ledger(path: str, top: int = 12) -> list[str]:
    """Markdown: per launch of a source export, the share of stall samples by reason and by opcode, and the `top`
    instructions by samples with their two main reasons."""
    out = []
    for i, (name, rows) in enumerate(_source_launches(path)):
        reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "(Not Issued)" not in c]
        total = sum(_number(r[SAMPLES]) or 0.0 for r in rows)
        if total <= 0:
            out += [f"**{i + 1}. `{name}`**: no stall samples", ""]
            continue
        by_reason = {c[len("stall_"):]: sum(_number(r[c]) or 0.0 for r in rows) for c in reasons}
        by_op: dict[str, float] = {}
        for r in rows:
            by_op[_opcode(r["Source"])] = by_op.get(_opcode(r["Source"]), 0.0) + (_number(r[SAMPLES]) or 0.0)

        def shares(d: dict, n: int) -> str:
            return ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(d.items(), key=lambda x: -x[1])[:n])

        out += [f"**{i + 1}. `{name}`**: {total:,.0f} samples over {len(rows)} instructions.", "",
                f"- by reason: {shares(by_reason, 8)}", f"- by opcode: {shares(by_op, 10)}", "",
                "| rank | address | instruction | share of samples | main reasons |", "|---|---|---|---|---|"]
        ranked = sorted(range(len(rows)), key=lambda j: -(_number(rows[j][SAMPLES]) or 0.0))[:top]
        for rank, j in enumerate(ranked, 1):
            r = rows[j]
            main = sorted(((_number(r[c]) or 0.0, c[len("stall_"):]) for c in reasons), reverse=True)[:2]
            text = " ".join(r["Source"].split())[:60]
            setter = _predicate_setter(rows, j) if _opcode(r["Source"]) == "BRA" else None
            if setter:  # a branch waits on what set its predicate (e.g. an mbarrier's try-wait on a TMA load)
                text += f"` on `{setter}"
            share = (_number(r[SAMPLES]) or 0.0) / total
            out.append(f"| {rank} | {r['Address'][-5:]} | `{text}` | {share:.1%} | "
                       + ", ".join(f"{n} {v / total:.1%}" for v, n in main if v > 0) + " |")
        out.append("")
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
    ap.add_argument("--stalls", nargs="+", metavar="CSV",
                    help="print the stall ledger of these ncu source-page CSV exports (SASS)")
    args = ap.parse_args()
    if args.stalls:
        for path in args.stalls:
            print("\n".join([f"`{os.path.basename(path)}`:", ""] + stall_ledger(path)))
        return
    if args.table:
        for path in args.table:
            print("\n".join([f"`{os.path.basename(path)}`:", ""] + table(path) + [""]))
        return
    profiled_call(args.shape, args.launch, args.warmup)


if __name__ == "__main__":
    main()
