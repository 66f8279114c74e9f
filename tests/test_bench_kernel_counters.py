"""bench/kernel_counters.py --table: Nsight Compute's raw CSV export as one markdown row per kernel launch."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "bench" / "kernel_counters.py"
_spec = importlib.util.spec_from_file_location("kernel_counters", _path)
kernel_counters = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(_path.parent.parent))
_spec.loader.exec_module(kernel_counters)

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def write_export(path, rows, time_unit="ms"):
    """An export as ncu writes it: a banner line, the metric names (after ID and Kernel Name), a units row."""
    metrics = [m for _, m, _ in kernel_counters.COLUMNS] + [STALL.format(s) for s in ("wait", "barrier", "gmma")]
    units = [time_unit] + [""] * (len(metrics) - 1)
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f)
        w.writerow(["ID", "Kernel Name"] + metrics)
        w.writerow(["", ""] + units)
        for i, (name, values) in enumerate(rows):
            w.writerow([str(i), name] + [values.get(m, "n/a") for m in metrics])


def test_table_converts_the_time_and_ranks_the_stalls(tmp_path):
    path = tmp_path / "report.csv"
    duration, busy = kernel_counters.COLUMNS[0][1], kernel_counters.COLUMNS[1][1]
    write_export(path, [("selected_block_bwd_kernel(int*, float*)", {
        duration: "1.25", busy: "24.5", "launch__registers_per_thread": "239",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed": "81.25",
        STALL.format("wait"): "1.37", STALL.format("barrier"): "1,280.5", STALL.format("gmma"): "0.10"})])
    lines = kernel_counters.table(str(path))
    assert len(lines) == 3 and lines[0].startswith("| kernel | us |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "`selected_block_bwd_kernel`"
    assert cells[1] == "1250"  # ms -> us
    assert cells[2] == "24.5" and cells[5] == "81.25" and cells[8] == "239"
    assert cells[4] == "-"  # a metric the export lacks (here "n/a") is shown as missing, not as 0
    assert cells[-1] == "barrier 1280.50, wait 1.37, gmma 0.10"  # largest first, thousands separators read


def test_table_refuses_a_file_that_is_not_an_export(tmp_path):
    path = tmp_path / "report.csv"
    path.write_text("==ERROR== the profiler could not read the counters\n")
    with pytest.raises(SystemExit, match="not an ncu raw CSV export"):
        kernel_counters.table(str(path))


def test_table_refuses_a_time_unit_it_cannot_convert(tmp_path):
    path = tmp_path / "report.csv"
    write_export(path, [("k", {kernel_counters.COLUMNS[0][1]: "3"})], time_unit="cycle")
    with pytest.raises(SystemExit, match="unit 'cycle'"):
        kernel_counters.table(str(path))
