"""bench/probe_phi.py's first variant is the launch configuration the model runs (so its column is the baseline).
Its --shapes are bench/shapes.py's batch_shapes (tests/test_bench_shapes.py)."""

from bench.probe_phi import VARIANTS


def test_the_first_variant_is_the_default_launch():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from nsa_model.ops import triton_impl as ti\n"
            "print(ti.LaunchConfig().phi_rows, ti._PHI_W1_ROWS, ti._PHI_DX_ROWS, ti._PHI_DX_OFFSETS)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert tuple(int(x) for x in out.stdout.split()) == VARIANTS[0][1:]
