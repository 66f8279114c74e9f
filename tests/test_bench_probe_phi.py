"""bench/probe_phi.py refuses a shape it cannot run before it starts on the GPU, and its first variant is the
launch configuration the model runs (so its column is the baseline)."""

import argparse

import pytest

from bench.probe_phi import VARIANTS, parse_shapes


def test_shapes_parse_as_batch_and_length():
    assert parse_shapes("16:2048,4:8192") == [(16, 2048), (4, 8192)]


@pytest.mark.parametrize("bad", ["4", "4:0", "0:8192", "a:b", "4:8192:1", ""])
def test_other_shapes_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_shapes(bad)


def test_the_first_variant_is_the_default_launch():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from nsa_model.ops import triton_impl as ti\n"
            "print(ti.LaunchConfig().phi_rows, ti._PHI_W1_ROWS, ti._PHI_DX_ROWS)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert tuple(int(x) for x in out.stdout.split()) == VARIANTS[0][1:]
