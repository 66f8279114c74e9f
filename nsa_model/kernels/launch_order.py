"""Programmatic dependent launch (PDL, Hopper and later): every kernel of this package starts with
wait_for_previous_grid(PDL).

A kernel launched with PDL may be put on the multiprocessors while the kernel before it in its stream is still
running, instead of after that kernel has finished and the launch has gone through. Its programs then wait at
`griddepcontrol.wait` until every program of the previous kernel has finished and its memory writes are
visible, so nothing may be read or written before it: that is why the wait is each kernel's first statement.
What it can save is the idle gap between two launches (about a microsecond each, hundreds of them in a training
step; kernels-notes.md v39, v41), and the previous kernel's tail, where its last programs leave multiprocessors
free.

PDL (a constexpr, LaunchConfig.pdl through nsa_model.ops.triton_impl):
  0  launched without PDL: nothing to wait for (the default; the interpreter and pre-Hopper GPUs)
  1  wait; the next kernel may launch once every program of this one has exited
  2  wait, then let the next kernel launch at once (`griddepcontrol.launch_dependents`): its programs take the
     multiprocessors this kernel's last programs leave free, and wait there for this one to end

A kernel waits for the whole previous grid, and that grid waited for the one before it, so everything earlier
in the stream is complete and visible after the wait, whatever kernel wrote it. Work from another stream is
ordered by an event, which stays a full dependency.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_MODES = ("off", "wait", "early")  # LaunchConfig.pdl's values; the index is the kernels' PDL constexpr


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()
