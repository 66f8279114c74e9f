"""The Triton kernels compile for the GPU (sm_90, Hopper) on a machine without one.

CI runs the kernels in Triton's interpreter, which executes their Python directly and so accepts code the
compiler rejects: a helper that returned early from inside a static `if` ran there and failed to compile on the
H100 (kernels-notes.md, v17; compiled Triton also visits the statements after such a return). Triton's front end, its LLVM back end and the ptxas bundled with it need no GPU, so
each kernel variant whose constexpr branches this project chooses at launch is compiled to a cubin here, in a
subprocess: this test session imports the kernels interpreted (TRITON_INTERPRET=1), the subprocess compiled.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# kernel -> (module, pointer dtypes by argument name (bf16 where not named), scalar types, constexprs, variants)
D64 = dict(DK=64, DV=64, BLOCK_DK=64, BLOCK_DV=64, DOT_PRECISION="tf32")
SEL = dict(H=12, G=2, SEL_BLOCK=64, BLOCK_S=64, N_SELECT=16, **D64)
RANGE = dict(H=12, G=2, BLOCK_M=64, BLOCK_N=64, EDGE_SPLIT=True, **D64)
KERNELS = {
    "selected_tiled_fwd_kernel": (
        "nsa_model.kernels.selected_tiled", dict(BLOCKS="i32", UNION="i32", COUNT="i32", LSE="fp32"),
        dict(T="i32", num_tiles="i32", scale="fp32", K_ROW="i32", V_ROW="i32"),
        dict(N_PAD=16, ROWS=64, TILE_Q=10, **SEL), [dict()]),
    "selected_tiled_bwd_dq_kernel": (
        "nsa_model.kernels.selected_tiled", dict(BLOCKS="i32", UNION="i32", COUNT="i32", LSE="fp32", DELTA="fp32"),
        dict(T="i32", num_tiles="i32", scale="fp32", K_ROW="i32", V_ROW="i32"),
        dict(N_PAD=16, ROWS=64, TILE_Q=10, **SEL), [dict()]),
    "range_attn_fwd_kernel": (
        "nsa_model.kernels.range_attention", dict(LSE="fp32"),
        dict(T="i32", num_queries="i32", num_keys="i32", scale="fp32", key_stride="i32", key_offset="i32",
             window="i32", K_ROW="i32", V_ROW="i32"),
        RANGE, [dict()]),
    "range_attn_bwd_dq_kernel": (
        "nsa_model.kernels.range_attention", dict(LSE="fp32", DELTA="fp32", LSE2="fp32", DELTA2="fp32"),
        dict(T="i32", num_queries="i32", num_keys="i32", scale="fp32", key_stride="i32", key_offset="i32",
             window="i32", K_ROW="i32", V_ROW="i32", num_keys2="i32", key_stride2="i32", key_offset2="i32",
             window2="i32", K2_ROW="i32", V2_ROW="i32"),
        dict(ACCUMULATE=False, **RANGE), [dict(TWO_RANGES=True), dict(TWO_RANGES=False)]),
    "selected_dq_sum_kernel": (
        "nsa_model.kernels.selected_by_block", dict(BLOCKS="i32"), dict(num_rows="i32"),
        dict(H=12, G=2, DK=64, BLOCK_DK=64, N_SELECT=16, BLOCK_R=32), [dict(NUM_ADD=n) for n in (0, 1, 2)]),
    "selected_block_bwd_kernel": (
        "nsa_model.kernels.selected_by_block",
        dict(LSE="fp32", DELTA="fp32", ORDER="i32", STARTS="i32", WORK_SEG="i32", WORK_CHUNK="i32", DK_ACC="fp32",
             DV_ACC="fp32"),
        dict(T="i32", num_blocks="i32", scale="fp32", K_ROW="i32", V_ROW="i32"),
        dict(ROWS=64, CHUNK=512, **SEL), [dict(DQ_MODE=1), dict(DQ_MODE=2)]),
}

COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, name, pointers, scalars, constexprs = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
signature = {}
for arg in fn.arg_names:
    if arg in constexprs:
        signature[arg] = "constexpr"
    elif arg in scalars:
        signature[arg] = scalars[arg]
    else:
        signature[arg] = "*" + pointers.get(arg, "bf16")
kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
print(len(kernel.asm["cubin"]))
"""


def _cases():
    for name, (module, pointers, scalars, constexprs, variants) in KERNELS.items():
        for variant in variants:
            label = ",".join(f"{k}={v}" for k, v in variant.items()) or "default"
            yield pytest.param(module, name, pointers, scalars, {**constexprs, **variant}, id=f"{name}[{label}]")


@pytest.mark.parametrize("module, name, pointers, scalars, constexprs", list(_cases()))
def test_kernel_compiles_for_hopper(module, name, pointers, scalars, constexprs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps([module, name, pointers, scalars, constexprs])],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) > 0  # a cubin of some bytes
