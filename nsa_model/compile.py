"""torch.compile of a model as training and the benchmarks run it: the mode's inductor options plus our own."""

from __future__ import annotations

import torch
import torch._inductor
import torch._inductor.config as inductor_config

# Inductor lowers a concatenation of a few computed inputs to one "pointwise cat" kernel, which evaluates every
# input's computation (masked) at each output element. The gradient of the fused q/k/v projection is such a
# cat: RoPE's backward of q and of the K sets, and the V gradients. As one kernel it moved about 0.75 TB/s (4.3
# ms per step for dense 125M at T = 2048 on the H100). As a ConcatKernel each input's kernel writes its own
# slice of the result (kernels-notes.md, v18). The limits are 0 so that no cat takes the pointwise form; the
# second option exists from torch 2.12.
_NO_POINTWISE_CAT = ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")


def compile_options(mode: str) -> dict:
    """The inductor options torch.compile(mode=mode) would use, with concatenations kept as ConcatKernels."""
    options = dict(torch._inductor.list_mode_options(mode))
    options.update({name: 0 for name in _NO_POINTWISE_CAT if hasattr(inductor_config, name)})
    return options


def compile_model(model: torch.nn.Module, mode: str = "default"):
    """torch.compile(model, mode=mode) with compile_options(mode) (torch.compile takes a mode or options)."""
    return torch.compile(model, options=compile_options(mode))
