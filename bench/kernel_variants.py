"""Kernel variants for the timing probes: a kernel module's source with text edits applied, loaded as a module of
its own. The variants' results are wrong by construction; the probes (probe_v32.py, probe_by_block.py) time them
to see what the edited-out piece costs."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "nsa_model" / "kernels"


def edited_module(kernel_file: str, name: str, edits: list[tuple[str, str]]):
    """nsa_model/kernels/<kernel_file> with each (old, new) of `edits` replaced, as a fresh module; None where an
    edit's text is not in the source (an edit of another version of the kernel: the probe skips that variant, and
    tests/test_bench_probe.py checks that none of the current edits is skipped)."""
    src = (KERNELS / kernel_file).read_text()
    for old, new in edits:
        if old not in src:
            return None
        src = src.replace(old, new)
    path = pathlib.Path(tempfile.mkdtemp()) / f"{pathlib.Path(kernel_file).stem}_{abs(hash(name))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
