"""bench/shapes.py: the benches' family:B:T and B:T arguments, refused before anything starts on the GPU."""

import argparse

import pytest

from bench.shapes import FAMILIES, ISSUE4_SHAPES, batch_shapes, family_shapes


def test_family_shapes_parse_in_the_order_given():
    assert family_shapes("paper:1:65536,125m:4:8192") == [("paper", 1, 65536), ("125m", 4, 8192)]


@pytest.mark.parametrize("bad", ["125m:4", "gpt:1:8192", "125m:0:8192", "125m:4:x", "125m:4:8192:1", ""])
def test_other_family_shapes_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        family_shapes(bad)


def test_family_shapes_take_the_callers_families():
    """bench/kernels.py checks against its own SHAPES, whose names are these."""
    assert family_shapes("x:2:64", families={"x": {}}) == [("x", 2, 64)]
    with pytest.raises(argparse.ArgumentTypeError, match="one of"):
        family_shapes("125m:2:64", families={"x": {}})


def test_the_families_are_the_anchors_configurations():
    assert FAMILIES == {"125m": dict(H=12, G=2, D=64), "paper": dict(H=64, G=4, D=128)}


def test_the_probes_default_shapes_are_the_rows_issue_4_targets():
    from bench.kernels import TARGETS
    assert sorted(family_shapes(ISSUE4_SHAPES)) == sorted(TARGETS)


def test_batch_shapes_parse_in_the_order_given():
    assert batch_shapes("16:2048,4:8192") == [(16, 2048), (4, 8192)]


@pytest.mark.parametrize("bad", ["4", "4:0", "0:8192", "a:b", "4:8192:1", ""])
def test_other_batch_shapes_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        batch_shapes(bad)


def test_kernels_bench_parses_its_timings_with_them():
    """--timings goes through family_shapes, so a malformed item is refused by argparse, not split by hand."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "bench" / "kernels.py"), "--timings", "125m:4"],
                         capture_output=True, text=True, cwd=root)
    assert out.returncode == 2 and "expected family:B:T" in out.stderr, out.stderr[-1000:]
