"""bench/kernel_counters.py --table: Nsight Compute's raw CSV export as one markdown row per kernel launch;
--stalls: its source page (SASS) as a ledger of where each launch's warps wait."""

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


def write_source_export(path, launches):
    """A source-page export as ncu writes it: per launch a "Kernel Name" line, a header, one row per instruction
    (address, SASS, samples, and per-reason samples, issued and not issued)."""
    reasons = ("long_sb", "barrier", "short_sb")
    head = (["Address", "Source", kernel_counters.SAMPLES, "# Samples"] + [f"stall_{r}" for r in reasons]
            + [f"stall_{r} (Not Issued)" for r in reasons])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in launches:
            w.writerow(["Kernel Name", name, ""])
            w.writerow(head)
            for address, sass, by_reason in rows:
                values = [by_reason.get(r, 0) for r in reasons]
                w.writerow([address, sass, str(sum(values)), "1"] + [f"{v:,}" for v in values] + ["0"] * 3)


def test_stall_ledger_ranks_instructions_and_names_what_a_branch_waits_on(tmp_path):
    path = tmp_path / "source.csv"
    write_source_export(path, [
        ("dkdv_kernel", [("0x08", "ISETP.NE.AND P0, PT, R2, RZ, PT", {}),  # an earlier setter of P0
                         ("0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], RZ", {}),
                         ("0x20", "USGXT.U32 UR6, UR6, 0x0", {"barrier": 1}),
                         ("0x30", "@!P0 BRA 0x90", {"long_sb": 6000}),
                         ("0x40", "WARPGROUP.ARRIVE", {"short_sb": 3000}),
                         ("0x50", "WARPGROUP.DEPBAR.LE gsb0, 0x0", {"barrier": 999})]),
        ("dq_kernel", [("0x10", "@P1 BRA 0x20", {"long_sb": 5})])])
    text = "\n".join(kernel_counters.stall_ledger(str(path), top=3))
    assert "**1. `dkdv_kernel`**: 10,000 samples over 6 instructions." in text
    assert "- by reason: long_sb 60.0%, short_sb 30.0%, barrier 10.0%" in text
    assert "- by opcode: BRA 60.0%, WARPGROUP 40.0%, USGXT 0.0%" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert rows[0] == "| 1 | 0x30 | `@!P0 BRA 0x90` on `SYNCS.PHASECHK.TRANS64.TRYWAIT` | 60.0% | long_sb 60.0% |"
    assert rows[1].startswith("| 2 | 0x40 | `WARPGROUP.ARRIVE` | 30.0% | short_sb 30.0%")
    assert rows[2].startswith("| 3 | 0x50 |") and len(rows) == 4  # top 3 of the first launch, 1 of the second
    assert "| 1 | 0x10 | `@P1 BRA 0x20` | 100.0% | long_sb 100.0% |" in text  # nothing before it sets P1


def test_stall_ledger_refuses_a_source_page_without_samples(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text('"Kernel Name","k",\n"Address","Source"\n"0x10","EXIT"\n')
    with pytest.raises(SystemExit, match="lacks 'Warp Stall Sampling"):
        kernel_counters.stall_ledger(str(path))
