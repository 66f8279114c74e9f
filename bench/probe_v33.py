"""Probe (timing only; tests/test_triton_gpu.py checks the results) of by_block's forward with the combine in the
same launch (slc_combine = "fused", kernels-notes.md v33) against the block kernel and the combine pass.

    python bench/probe_v33.py --out DIR [--commit SHA] [--suffix=-v33a]

For each 125M shape, on NSA's own selections of random inputs: the selected branch's forward (`_selected_fwd`,
index included) under each variant below, as CUDA graphs (do_bench_cudagraph medians), the separate pass timed
first and last so that its drift shows. Writes probe-<device>-<date><suffix>.json and .md.
"""

import argparse
import dataclasses
import datetime
import json
import pathlib

import torch
import triton
from triton.testing import do_bench_cudagraph

from bench.provenance import git_commit
from nsa_model.config import NSAConfig
from nsa_model.ops import triton_impl as ti

SHAPES = {"125m 4x8k": (4, 8192), "125m 16x2k": (16, 2048), "125m 1x32k": (1, 32768)}  # H=12, G=2, D=64
VARIANTS = {
    "pass": dict(),
    "fused 512, lag 2": dict(slc_combine="fused"),
    "fused 512, lag 2, discard": dict(slc_combine="fused", slc_combine_discard=True),
    "fused 256, lag 2": dict(slc_combine="fused", slc_combine_queries=256),
    "fused 1024, lag 2": dict(slc_combine="fused", slc_combine_queries=1024),
    "fused 512, lag 1": dict(slc_combine="fused", slc_combine_lag=1),
    "fused 512, lag 4": dict(slc_combine="fused", slc_combine_lag=4),
    "fused 256, lag 4, discard": dict(slc_combine="fused", slc_combine_queries=256, slc_combine_lag=4,
                                      slc_combine_discard=True),
    "pass again": dict(),
}


def probe(B: int, T: int) -> dict:
    cfg, H, G, D = NSAConfig(), 12, 2, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(B, T, G, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    tc = cfg.num_cmp_tokens(T)
    kc, vc = (torch.randn(B, tc, G, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    scale = D ** -0.5
    _, lse = ti._range_fwd(q, kc, vc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
    blocks = ti.select_blocks(q, kc, lse, cfg, scale)
    row = {}
    for name, options in VARIANTS.items():
        launch = dataclasses.replace(ti.LaunchConfig(), slc_kernel="by_block", **options)
        with ti.use_launch_config(launch):
            row[name] = do_bench_cudagraph(lambda: ti._selected_fwd(q, k, v, blocks, cfg.sel_block, scale), rep=200)
    return row


def write(out_dir: pathlib.Path, suffix: str, commit: str, results: dict) -> pathlib.Path:
    device = torch.cuda.get_device_name()
    tag = device.split()[-1].lower() if device.startswith("NVIDIA") else "gpu"
    stamp = datetime.datetime.now(datetime.timezone.utc)
    stem = out_dir / f"probe-{tag}-{stamp:%Y-%m-%d}{suffix}"
    meta = {"device": device, "date": f"{stamp:%Y-%m-%d %H:%M} UTC", "commit": commit, "torch": torch.__version__,
            "triton": triton.__version__}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "us": results}, indent=1))
    names = list(VARIANTS)
    lines = [f"# Probe v33: by_block's forward with the combine fused: {device}, {meta['date']}", "",
             f"commit {commit}, torch {meta['torch']}, triton {meta['triton']}. `bench/probe_v33.py`: the selected "
             "branch's forward (index, block kernel, combine), by_block forced, on NSA's own selections of random "
             "inputs; `do_bench_cudagraph` medians, microseconds per call. fused N, lag L: chunks of N queries, "
             "each combined after the next L chunks' block items; discard: the partials' L2 lines dropped once "
             "read. Ratios against the mean of the two pass timings.", "",
             "| variant | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for name in names:
        cells = []
        for row in results.values():
            base = (row["pass"] + row["pass again"]) / 2
            cells.append(f"{row[name]:.1f} ({row[name] / base:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--suffix", default="-v33")
    args = parser.parse_args()
    results = {}
    for shape, (B, T) in SHAPES.items():
        results[shape] = {name: ms * 1000 for name, ms in probe(B, T).items()}
        print(shape, {k: round(v, 1) for k, v in results[shape].items()}, "us", flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(write(out_dir, args.suffix, args.commit or git_commit(), results))


if __name__ == "__main__":
    main()
