"""Kernel variants for the timing probes: a kernel module's source with text edits applied, loaded as a module of
its own. The variants' results are wrong by construction; the probes (probe_v32.py, probe_by_block.py,
probe_per_query.py) time them to see what the edited-out piece costs. Also what those probes share: inputs with
NSA's own selections, and the table of times they write."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "nsa_model" / "kernels"


def edited_module(kernel_file: str, name: str, edits: list[tuple[str, str]]):
    """nsa_model/kernels/<kernel_file> with each (old, new) of `edits` replaced, as a fresh module; None where an
    edit's text is not in the source (an edit of another version of the kernel) or the edit changes nothing (a
    replacement built from text it does not contain): the probe skips that variant, and tests/test_bench_probe.py
    checks that none of the current edits is skipped."""
    src = (KERNELS / kernel_file).read_text()
    for old, new in edits:
        if old not in src or old == new:
            return None
        src = src.replace(old, new)
    path = pathlib.Path(tempfile.mkdtemp()) / f"{pathlib.Path(kernel_file).stem}_{abs(hash(name))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def selection_inputs(B: int, T: int, H: int, G: int, D: int):
    """(cfg, q, k, v, do, blocks, scale): random bf16 inputs on the GPU (seed 0) and the blocks NSA's own selection
    picks for them (the compressed branch's lse from its range forward, then select_blocks), NSAConfig's defaults."""
    import torch

    from nsa_model.config import NSAConfig
    from nsa_model.ops import triton_impl as ti

    cfg = NSAConfig()
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
    k, v, do = (torch.randn(B, T, n, D, device="cuda", generator=gen).bfloat16() for n in (G, G, H))
    tc = cfg.num_cmp_tokens(T)
    kc, vc = (torch.randn(B, tc, G, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    scale = D ** -0.5
    _, lse_cmp = ti._range_fwd(q, kc, vc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
    blocks = ti.select_blocks(q, kc, lse_cmp, cfg, scale)
    return cfg, q, k, v, do, blocks, scale


def write_times(out_dir, suffix: str, commit: str, results: dict, *, title: str, note: str, unit: str,
                fmt: str, column=str) -> pathlib.Path:
    """probe-<device>-<date><suffix>.json and .md of results {column key: {row name: time}}: the JSON with the
    times under `unit`, the markdown a table of rows by columns (headed column(key)) after the title and note."""
    import json

    from bench.provenance import result_file, result_stem

    stem, meta = result_stem(out_dir, "probe", suffix, commit)
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, unit: results}, indent=1))
    names = list(next(iter(results.values())))
    lines = [f"# Probe: {title}: {meta['device']}, {meta['date']}", "",
             f"commit {commit}, torch {meta['torch']}, triton {meta['triton']}. {note}", "",
             "| | " + " | ".join(column(key) for key in results) + " |", "|---|" + "---|" * len(results)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(format(row[name], fmt) for row in results.values()) + " |")
    result_file(stem, ".md").write_text("\n".join(lines) + "\n")
    return stem
