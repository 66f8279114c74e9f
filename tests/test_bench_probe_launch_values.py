"""bench/probe_launch_values.py refuses a field, value or setting before any GPU work, and builds one config per
value. In a subprocess with TRITON_INTERPRET=1: the probe imports the triton backend, which must not be imported
into this test session compiled for CUDA (tests/test_triton_kernels.py imports it interpreted)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = r"""
from bench.probe_launch_values import base_config, launch_configs, value_list
from nsa_model.ops import triton_impl


def refused(fn, message):
    try:
        fn()
    except SystemExit as err:
        assert message in str(err), (message, str(err))
        return
    raise AssertionError(f"not refused: {message}")


default = triton_impl.LaunchConfig()
# one config per value, differing only in the field
configs = launch_configs(default, "range_dkdv_q_chunk", [0, 2048])
assert [c.range_dkdv_q_chunk for c in configs.values()] == [0, 2048]
assert configs[2048].slc_block_chunk == default.slc_block_chunk
# a bool field takes 0 and 1
assert [c.side_stream for c in launch_configs(default, "side_stream", [1, 0]).values()] == [True, False]
# a tile field takes tuples
tiles = launch_configs(default, "range_dq", [(64, 64, 4, 2), (64, 64, 4, 3)])
assert [c.range_dq for c in tiles.values()] == [(64, 64, 4, 2), (64, 64, 4, 3)]
refused(lambda: launch_configs(default, "range_dq", [2]), "range_dq takes tuples")
refused(lambda: launch_configs(default, "range_heads", [(1, 2)]), "range_heads takes ints")
refused(lambda: launch_configs(default, "range_dq", [(64, 64, 4)]), "tuple of 4 positive ints")
# fields and values the probe or LaunchConfig refuses
refused(lambda: launch_configs(default, "slc_kernel", [0]), "not an integer, bool or tile LaunchConfig field")
refused(lambda: launch_configs(default, "side_stream", [0, 2]), "a bool: 0 or 1")
refused(lambda: launch_configs(default, "range_dkdv_q_chunk", [0, -1]), "must be an int >= 0")
# --launch changes the base of every value
base = base_config(default, ["slc_auto_tiled_blocks=64", "side_stream=False", "slc_kernel=tiled"])
assert (base.slc_auto_tiled_blocks, base.side_stream, base.slc_kernel) == (64, False, "tiled")
assert [(c.slc_tile_rows, c.slc_auto_tiled_blocks) for c in launch_configs(base, "slc_tile_rows", [64, 32]).values()] \
    == [(64, 64), (32, 64)]
for setting, message in [("nope=1", "nope"), ("side_stream=1", "must be a bool"),
                         ("slc_tile_rows=x", "must be an int"), ("slc_kernel=fast", "must be one of")]:
    refused(lambda: base_config(default, [setting]), message)
# values: distinct integers
assert value_list("0,2048") == [0, 2048]
assert value_list("(64,64,4,2),(64, 64, 4, 3)") == [(64, 64, 4, 2), (64, 64, 4, 3)]
for bad in ("0,x", "0,0", "1.5", "(64,64,4,2),(64,64,4,2)", "'a'", ""):
    try:
        value_list(bad)
    except Exception:
        continue
    raise AssertionError(f"value_list accepted {bad!r}")
print("ok")
"""


def test_the_probe_builds_one_config_per_value_and_refuses_bad_input_before_the_gpu():
    out = subprocess.run([sys.executable, "-c", CHECKS], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"
