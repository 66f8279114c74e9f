"""nsa_model/precompile.py: an NSA layer's Triton kernels compiled before a step, side by side, without running.

The compile needs no GPU: in a process of its own without TRITON_INTERPRET (the kernels must be Triton's compiled
kind), a stand-in driver reports an H100, records the launchers built, and has nothing to launch with, so a kernel
that tried to run would fail the test. The launchers' CUDA-tensor guards are lifted there: the pass's tensors are CPU ones, and its values are
never computed anyway. On GPUs the time it saves is measured by bench/probe_trial_start.py --precompile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa_model.config import get_preset
from nsa_model.model import Transformer
from nsa_model.precompile import compile_nsa_kernels

_DRY_PASS = r"""
import json, sys, threading
import torch, triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


launchers = []


class RecordingLauncher:  # what the precompile builds: the launcher of each kernel's signature (no C compiled here)
    def __init__(self, src, metadata):
        launchers.append([src.fn.__name__, threading.current_thread().name])


class CompileOnlyDriver:  # an H100 for the compiler; no memory, no device utilities: a launch would raise
    launcher_cls = RecordingLauncher

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


driver.set_active(CompileOnlyDriver())
import nsa_model.ops as ops
import nsa_model.ops.triton_impl as triton_impl

ops._triton_interpreting = lambda: True  # the guards that want CUDA tensors (or the interpreter) lifted
triton_impl._check_inputs = lambda **tensors: None
from nsa_model.config import get_preset
from nsa_model.model import Transformer
from nsa_model.precompile import compile_nsa_kernels

heard = []


def listener(*, src, metadata, metadata_group, times, cache_hit):
    heard.append([src.fn.module, src.fn.__name__, threading.current_thread().name, cache_hit])


triton.knobs.compilation.listener = listener
torch.manual_seed(0)
model = Transformer(get_preset("tiny"), backend="triton")
before = {k: v.clone() for k, v in model.state_dict().items()}
rng = torch.get_rng_state()
first = compile_nsa_kernels(model, batch=1, seq_len=200, workers=2)
heard_first = len(heard)
launchers_first = list(launchers)
again = compile_nsa_kernels(model, batch=1, seq_len=200, workers=2)


@triton.jit
def add_one(X):
    tl.store(X, tl.load(X) + 1)


# A launch from a thread started inside the context (as autograd's CUDA backward thread is) still goes to the pool.
from nsa_model.precompile import compile_only_launches

with compile_only_launches(2):
    other = threading.Thread(target=lambda: add_one[(1,)](torch.zeros(1)), name="like-autograd")
    other.start()
    other.join()
print(json.dumps({
    "first": first, "again": again, "heard": heard[:heard_first], "from_a_thread": heard[heard_first:],
    "launchers": launchers_first,
    "untouched": all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    and all(p.grad is None for p in model.parameters()),
    "rng_kept": torch.equal(rng, torch.get_rng_state()),
}))
"""


def test_a_layers_kernels_compile_side_by_side_before_the_step_and_none_runs(tmp_path):
    """Every kernel of the tiny NSA layer's forward and backward compiles (the listener hears each, from the pool's
    two threads), none is launched (the driver cannot), a second call finds them all in the kernels' in-memory
    caches (its launches are keyed as a step's), and the model, its gradients and the random generator are left as
    they were. A launch from another thread goes to the pool as well: on a GPU autograd runs the backward on a
    thread of its own (the first GPU run, v76a, compiled the backward's 9 kernels there, one after another)."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "dry_pass.py"
    script.write_text(_DRY_PASS)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(root),
           "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    heard = out["heard"]
    assert out["first"] == len(heard) >= 15  # the tiny layer: 20 kernels
    assert all(module.startswith("nsa_model.kernels.") and not hit for module, _, _, hit in heard)
    names = {name for _, name, _, _ in heard}
    # the core's forward, its selection, and its backward's kernels, with RoPE's and phi's on either side
    assert {"range_attn_fwd_kernel", "select_blocks_kernel", "range_attn_bwd_dq_kernel", "range_attn_bwd_dkdv_kernel",
            "rope_split_kernel", "phi_fwd_kernel", "phi_bwd_x_kernel"} <= names
    assert len({thread for _, _, thread, _ in heard}) == 2
    assert all(thread.startswith("nsa-compile") for _, _, thread, _ in heard)
    # each compiled kernel's launcher built too, on the pool, so the first launch finds it in Triton's cache
    assert sorted(name for name, _ in out["launchers"]) == sorted(name for _, name, _, _ in heard)
    assert all(thread.startswith("nsa-compile") for _, thread in out["launchers"])
    assert out["again"] == 0
    # a launch from a thread the context did not start compiles on the pool too
    assert [(name, thread[:11]) for _, name, thread, _ in out["from_a_thread"]] == [("add_one", "nsa-compile")]
    assert out["untouched"] and out["rng_kept"]


def test_nothing_to_compile_without_triton_layers_or_in_the_interpreter():
    """Layers on the torch backend, dense attention and (where this process interprets Triton) the interpreter's
    kernels compile nothing: 0. A batch or length below 1 is refused by name."""
    assert compile_nsa_kernels(Transformer(get_preset("tiny"), backend="torch"), batch=1, seq_len=64) == 0
    assert compile_nsa_kernels(Transformer(get_preset("tiny-dense")), batch=1, seq_len=64) == 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert compile_nsa_kernels(Transformer(get_preset("tiny"), backend="triton"), batch=1, seq_len=64) == 0
    with pytest.raises(ValueError, match="batch and seq_len must be >= 1, got 0 and 64"):
        compile_nsa_kernels(Transformer(get_preset("tiny"), backend="torch"), batch=0, seq_len=64)
