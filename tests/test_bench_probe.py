"""bench/probe_v32.py builds its selection-kernel variants by editing the kernel's source: each edit must still
find its text in kernels/selection.py, or the probe would skip that variant without anyone noticing."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_selection_variant_of_the_probe_applies_to_the_kernel_as_it_is():
    # In a subprocess: the probe imports the triton backend, which this test session imports interpreted.
    code = ("import bench.probe_v32 as p\n"
            "missing = [n for n, e in p.SELECT_EDITS.items() if p.variant(n, e) is None]\n"
            "assert not missing, missing\n"
            "print(len(p.SELECT_EDITS))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "4"


def test_every_by_block_variant_of_the_probe_applies_to_the_kernels_as_they_are():
    """bench/probe_by_block.py's variants edit kernels/selected_by_block.py the same way."""
    code = ("import bench.probe_by_block as p\n"
            "edits = {**p.FORWARD_EDITS, **p.BACKWARD_EDITS}\n"
            "missing = [n for n, e in edits.items() if p.variant(n, e) is None]\n"
            "assert not missing, missing\n"
            "print(len(edits))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "7"
