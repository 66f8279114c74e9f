"""Guards of the training loop: the non-finite step guard and the progress watchdog."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

log = logging.getLogger(__name__)


class NonFiniteStepError(RuntimeError):
    pass


class WatchdogTimeout(RuntimeError):
    pass


class NonFiniteGuard:
    """Counts steps whose loss or gradient is NaN/inf. Such a step is skipped by the caller (no update: the fused
    optimizer's found_inf on the device, or no optimizer call; pipeline/train/loop.py); after `max_consecutive` of
    them in a row the run stops: continuing would only waste the cluster."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.skipped_total = 0
        self.consecutive = 0

    def observe(self, step: int, finite: bool) -> bool:
        """Record step's verdict (the same on every rank); True means apply the update."""
        if finite:
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.consecutive += 1
        log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in total)",
                    step, self.consecutive, self.skipped_total)
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteStepError(
                f"step {step}: {self.consecutive} consecutive steps with a non-finite loss or gradient "
                f"(train.max_consecutive_nonfinite={self.max_consecutive}); stopping. The last good checkpoint "
                f"is kept; lower the LR or inspect the data around this step.")
        return False

    def state_dict(self) -> dict[str, int]:
        return {"skipped_total": self.skipped_total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_total, self.consecutive = int(state["skipped_total"]), int(state["consecutive"])


def format_all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """Fails the training thread when one phase of one step makes no progress for `timeout_s` seconds.

    The loop calls beat(step, phase) whenever it enters a phase. On a timeout the watchdog logs every thread's
    stack (and writes it to dump_dir when given), then raises WatchdogTimeout in the training thread (delivered
    at its next Python bytecode). A thread stuck inside C (a collective that never returns) cannot take an
    exception: after `grace_s` more seconds the process exits, so the run fails and never hangs silently.
    """

    def __init__(self, timeout_s: float, *, rank: int, dump_dir: str | None = None, grace_s: float = 30.0,
                 poll_s: float | None = None):
        self.timeout_s, self.rank, self.dump_dir, self.grace_s = timeout_s, rank, dump_dir, grace_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self._target = threading.get_ident()  # the training thread: the one that creates the watchdog
        self._step, self._phase, self._since = -1, "start", time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-rank{rank}", daemon=True)
        self.fired: str | None = None

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def beat(self, step: int, phase: str) -> None:
        self._step, self._phase, self._since = step, phase, time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            stalled = time.monotonic() - self._since
            if stalled < self.timeout_s:
                continue
            self.fired = (f"watchdog: rank {self.rank} made no progress for {stalled:.0f} s at step {self._step}, "
                          f"phase {self._phase!r} (train.watchdog_seconds={self.timeout_s})")
            stacks = format_all_stacks()
            log.error("%s\n%s", self.fired, stacks)
            print(f"{self.fired}\n{stacks}", file=sys.stderr, flush=True)
            if self.dump_dir is not None:
                path = Path(self.dump_dir) / f"rank{self.rank}-step{self._step}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{self.fired}\n{stacks}")
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target),
                                                       ctypes.py_object(WatchdogTimeout))
            if self._stop.wait(self.grace_s):
                return  # the training thread unwound and closed the watchdog
            print(f"{self.fired}; the training thread did not unwind within {self.grace_s} s: exiting",
                  file=sys.stderr, flush=True)
            os._exit(70)
