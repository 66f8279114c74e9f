"""bench/probe_selection.py: its two measures of how much neighbouring queries share their selected blocks, its
--steps parsing, and one short run on the CPU (the tiny preset, no timings: those need CUDA)."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.probe_selection import parse_steps, shared_with_previous, union_ratio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks(rows):
    """[1, T, 1, n] int32 from one list of chosen blocks per query."""
    return torch.tensor(rows, dtype=torch.int32).view(1, len(rows), 1, len(rows[0]))


def test_union_counts_a_tiles_distinct_blocks_over_n():
    # tiles of 2 queries: {0, 1} | {0, 1} -> 2 blocks; {0, 2} | {1, 3} -> 4; the last tile {2, none} -> 1
    blocks = _blocks([[0, 1], [1, 0], [0, 2], [1, 3], [2, -1]])
    assert union_ratio(blocks, tile_q=2) == pytest.approx((2 + 4 + 1) / 3 / 2)


def test_union_leaves_out_tiles_without_a_choice():
    blocks = _blocks([[0, 1], [0, 1], [-1, -1], [-1, -1]])
    assert union_ratio(blocks, tile_q=2) == pytest.approx(1.0)


def test_shared_is_the_fraction_of_a_querys_blocks_the_query_before_chose():
    # query 1: 1 of {0, 1} was query 0's; query 2: its one block, 1; query 3: its one block, 1 (a -1 slot is no
    # block: the -1 of query 2 does not match it)
    blocks = _blocks([[0, 3], [0, 1], [1, -1], [-1, 1]])
    assert shared_with_previous(blocks) == pytest.approx((0.5 + 1.0 + 1.0) / 3)


def test_steps_parse_ascending_and_distinct():
    assert parse_steps("0,50,400") == [0, 50, 400]
    for bad in ("400,50", "0,0", "-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_steps(bad)


def test_a_short_run_on_the_cpu_writes_each_steps_layers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "probe_selection.py"), "--preset", "tiny",
                          "--seq-len", "128", "--batch", "1", "--steps", "0,2", "--out", str(tmp_path),
                          "--commit", "test"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("probe-selection-cpu-*.json")
    result = json.loads(path.read_text())
    assert [r["step"] for r in result["records"]] == [0, 2]
    tile_q = result["tile_q"]
    for record in result["records"]:
        assert len(record["layers"]) == 4  # the tiny preset's layers
        for layer in record["layers"]:
            assert 0.0 < layer["union"] <= tile_q and 0.0 <= layer["shared"] <= 1.0
            assert "times" not in layer  # timings only on CUDA
    assert (tmp_path / path.name.replace(".json", ".md")).exists()
