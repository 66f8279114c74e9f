"""The Triton kernels of a model's NSA layers compiled before its first step, side by side.

    from nsa_model.precompile import compile_nsa_kernels
    compile_nsa_kernels(model, batch=4, seq_len=8192, dtype=torch.bfloat16)   # before the first training step

Triton compiles a kernel at its first launch, on the launching thread, one after another: a GPU run's first step
spent about 14 s compiling an NSA layer's 20 kernels, and a sweep's trial at a new l' or n 6-8 s on the 9 that
depend on them (bench/results/kernels-notes.md v73, v75). Here a stand-in layer of each NSA configuration runs
its forward and backward once with every Triton launch turned into Triton's warmup (compile, do not run), inside
Triton's AsyncCompileMode over a thread pool: the compilations run side by side (Triton's passes and ptxas leave
the GIL) and each lands in its kernel's in-memory cache and in Triton's cache folder, where the step's launches
find it. Each compilation is followed, on the same thread, by the build of the kernel's launcher: the C module,
one per kernel signature, that Triton otherwise builds with the host's C compiler at the kernel's first launch and
keeps in its cache folder. On a node whose Triton cache was empty those builds were about 7 s of the first step
(bench/results/kernels-notes.md v77).

No value of the pass is ever computed: the kernels do not run, so their outputs hold whatever memory they were
given. That is sound because nothing in nsa_model reads a device value on the host (no host sync): the launches a
pass makes follow from shapes, dtypes and the launch config alone, so the stand-in's are the step's. The
stand-in is built on the meta device and given uninitialized memory: it draws nothing from the random generators,
and the model's own parameters, gradients and statistics are not touched.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from nsa_model.attention import NSAAttention
from nsa_model.ops import resolve_backend


def compile_nsa_kernels(model: nn.Module, batch: int, seq_len: int, dtype: torch.dtype | None = None,
                        workers: int | None = None) -> int:
    """Compiles every Triton kernel that model's NSA attention layers launch in a forward and backward of [batch,
    seq_len] tokens (under autocast to dtype, where given, as the training step runs), with up to `workers`
    compilations at once (default: the CPUs this process may use). Returns how many kernels it compiled or read
    from Triton's cache folder; kernels already compiled in this process count as none. Layers whose attention
    does not run the Triton kernels, and an interpreted Triton (TRITON_INTERPRET=1, nothing to compile), add
    nothing."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"compile_nsa_kernels: batch and seq_len must be >= 1, got {batch} and {seq_len}")
    layers = {}  # one stand-in per configuration: the layers of a model usually share one
    for module in model.modules():
        if isinstance(module, NSAAttention):
            weight = module.wq.weight
            if resolve_backend(module.backend, weight) == "triton":
                layers.setdefault((module.cfg, module.backend, module.recompute, weight.device), module)
    if not layers:
        return 0
    from nsa_model.ops.triton_impl import INTERPRETED

    if INTERPRETED:  # the interpreter's kernels compile nothing
        return 0
    workers = workers or len(os.sched_getaffinity(0))
    compiled = 0
    for cfg, backend, recompute, device in layers:
        with torch.device("meta"):
            stand_in = NSAAttention(cfg, backend=backend, recompute=recompute)
        stand_in = stand_in.to_empty(device=device)
        x = torch.empty(batch, seq_len, cfg.dim, device=device, requires_grad=True)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext())
        with compile_only_launches(workers) as mode, autocast:
            out = stand_in(x)
            torch.autograd.grad(out, [x, *stand_in.parameters()], torch.empty_like(out))
        compiled += len(mode.future_kernels)
    return compiled


def _launcher_built(kernel):
    """kernel, once Triton's launcher for its signature sits in Triton's cache folder: building one compiles C
    (gcc, outside the GIL) where the folder lacks it. The kernel's first launch makes its own launcher from that
    folder, and loads the kernel into the device's context, on the launching thread."""
    from triton.runtime.driver import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)
    return kernel


def _compile_and_build_launcher_mode(pool):
    """Triton's AsyncCompileMode whose pool also builds each compiled kernel's launcher, right after compiling it."""
    from triton.runtime import _async_compile

    class Mode(_async_compile.AsyncCompileMode):
        def submit(self, key, compile_fn, finalize_fn):
            return super().submit(key, lambda: _launcher_built(compile_fn()), finalize_fn)

    return Mode(pool)


@contextlib.contextmanager
def compile_only_launches(workers: int):
    """Within: each launch of a Triton kernel (kernel[grid](...)) compiles it, builds its launcher, and returns
    without running it, the compilations going to a pool of `workers` threads (Triton's AsyncCompileMode), from
    whichever thread launches (autograd runs a CUDA backward on a thread of its own, which does not see the mode
    this thread entered); on leaving, every compilation has finished (its error raised) and sits in its kernel's
    cache. Yields the AsyncCompileMode. The switch is Triton's JITFunction.run, for the whole process: nothing else
    may launch a Triton kernel meanwhile (its launch would not run), which holds before a run's first step."""
    from triton.runtime import JITFunction, _async_compile

    launch = JITFunction.run
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="nsa-compile") as pool:
        mode = _compile_and_build_launcher_mode(pool)

        def compile_only(self, *args, grid, warmup, **kwargs):
            token = _async_compile.active_mode.set(mode)
            try:
                return launch(self, *args, grid=grid, warmup=True, **kwargs)
            finally:
                _async_compile.active_mode.reset(token)

        JITFunction.run = compile_only
        try:
            with mode:
                yield mode
        finally:
            JITFunction.run = launch
