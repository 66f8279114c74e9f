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


CHECK_KERNELS = """
import bench.kernels as k
gpu = k.ti.LaunchConfig()  # the GPU's defaults (this interpreter session's own config is the interpreter's)
for case in k.CHECKS:
    name, cfg, shape = k.check_case(case)
    kernel = k.ti.attended_kernel(shape["H"] // shape["G"], shape["T"], cfg.sel_block, cfg.n_selected, gpu)
    print(name, kernel, cfg.sel_block, cfg.n_selected)
"""


def _run_with_bench(code: str) -> str:
    """stdout of `code`, which imports bench.kernels, run in a subprocess: bench/kernels.py imports the triton
    backend, which this test session imports interpreted."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_every_sweep_candidate_and_variant_is_a_valid_launch_config():
    assert int(_run_with_bench(CODE).strip()) > 50


def test_the_gpu_checks_reach_each_selected_variant_auto_picks():
    """The bf16 checks on the GPU (bench/kernels.py CHECKS) are the only run of each selected variant at its real
    shapes with gradients. A check named for a variant must still get it from auto when auto's lines move (v53
    moved the per-query check from T = 16384 to 16448), and every variant auto can pick must have a check."""
    lines = [line.split() for line in _run_with_bench(CHECK_KERNELS).strip().splitlines()]
    picked = {name: kernel for name, kernel, _, _ in lines}
    assert picked["paper_T16k_per_query"] == "per_query"
    assert picked["paper_T8k"] == "tiled"
    assert {"by_block", "tiled_by_block", "tiled", "per_query"} <= set(picked.values()), picked
    # and at NSA settings other than the paper's (l', n), as a Tune sweep runs them: each variant again
    other = {kernel for _, kernel, sel_block, n in lines if (sel_block, n) != ("64", "16")}
    assert {"by_block", "tiled_by_block", "tiled", "per_query"} <= other, lines
    for name, kernel, _, _ in lines:  # a check named for its variant gets it
        for variant in ("per_query", "tiled_by_block"):
            assert not name.endswith(variant) or kernel == variant, (name, kernel)
