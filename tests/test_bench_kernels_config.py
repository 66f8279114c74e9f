"""bench/kernels.py's sweep candidates and side-by-side variants are LaunchConfig changes: each must still name
fields that exist and values the config accepts, or a sweep on the GPU would drop that candidate as an error
(`sweep_launch_configs` scores a refused candidate as infinitely slow) and a variant column would read "-"."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = """
import dataclasses
import bench.kernels as k
base = k.ti.LaunchConfig()
count = 0
for group, (variants, shapes) in k.SWEEP_GROUPS.items():
    assert shapes and all(family in k.SHAPES for family, _, _ in shapes), group
    for v in variants:
        dataclasses.replace(base, **v)
        count += 1
for table in (k.SELECT_VARIANTS, k.SELECTED_VARIANTS, k.RANGE_VARIANTS):
    for name, v in table.items():
        dataclasses.replace(base, **v)
        count += 1
print(count)
"""


def test_every_sweep_candidate_and_variant_is_a_valid_launch_config():
    # In a subprocess: bench/kernels.py imports the triton backend, which this test session imports interpreted.
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) > 50
