"""The attention core's time across NSA settings, the axes a Tune sweep varies, against dense cuDNN in the same run.

    python bench/nsa_settings.py --shapes 125m:4:8192,paper:1:65536 --sel-block 32,64,128 --n-selected 8,16,32 \
        --out DIR --commit SHA

pipeline/tune.py sweeps NSA's selection block size l' and block count n (and optionally l, d, w) against tokens/s
and validation loss. Every trial runs our kernels at its own settings, while bench/kernels.py times them at the
paper's only (l = 32, d = 16, l' = 64, n = 16, w = 512). This script answers what a setting costs, and whether a
setting falls off the tuned path (a variant or tile picked for l' = 64, n = 16 that is slow elsewhere).

For each shape: dense cuDNN fwd+bwd once before the grid and once after it (CUDA graphs; the ratio is to their
mean, and their spread is printed as the run's drift). Then for each (l', n), the other fields PAPER_NSA's unless
--nsa sets them: a bf16 check of outputs, every input gradient and the selected sets against the float64
reference on three query ranges of the real shape (the first, the middle and the last CHECK_QUERIES queries, with
the kernels run over the whole sequence, so the checked run is the timed one), then NSA fwd+bwd as one CUDA graph.
A setting NSAConfig refuses is refused before anything starts. Writes DIR/nsa-settings-<device>-<date><suffix>.md,
.json and .png (one heatmap of NSA / cuDNN per shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.launch import launch_overrides  # noqa: E402
from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402
from bench.shapes import FAMILIES, PAPER_NSA, family_shapes  # noqa: E402
from nsa_model.config import NSAConfig  # noqa: E402

CHECK_QUERIES = 256  # queries of each checked range
OTHER_FIELDS = ("cmp_block", "cmp_stride", "window", "n_init_blocks", "n_local_blocks")  # --nsa may set these


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 32,64,128") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be an integer >= 1, none repeated")
    return values


def settings_grid(sel_blocks: list[int], n_selected: list[int], others: dict) -> list[NSAConfig]:
    """Every (l', n) of the grid over PAPER_NSA's other fields and `others`; ValueError naming the first setting
    that NSAConfig refuses (l' not a multiple of d, l > l', n below the forced blocks)."""
    grid = []
    for sel_block, n in itertools.product(sel_blocks, n_selected):
        try:
            grid.append(dataclasses.replace(PAPER_NSA, **others, sel_block=sel_block, n_selected=n))
        except ValueError as e:
            raise ValueError(f"setting l'={sel_block}, n={n} (with {others or 'the paper fields'}): {e}") from None
    return grid


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=family_shapes, default="125m:4:8192,paper:1:65536",
                    help=f"comma-separated family:B:T, family one of {sorted(FAMILIES)}")
    ap.add_argument("--sel-block", type=int_list, default=[32, 64, 128], help="l' values")
    ap.add_argument("--n-selected", type=int_list, default=[8, 16, 32], help="n values")
    ap.add_argument("--nsa", action="append", default=[], metavar="FIELD=VALUE",
                    help=f"another NSAConfig field for every setting (repeatable), one of {OTHER_FIELDS}")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also each setting's GPU time per kernel (torch.profiler)")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                    help="a LaunchConfig field to change for this run (repeatable)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    others = {}
    for item in args.nsa:
        name, sep, value = item.partition("=")
        if not sep or name not in OTHER_FIELDS or not value.lstrip("-").isdigit():
            ap.error(f"--nsa: expected FIELD=INT with FIELD one of {OTHER_FIELDS}, got {item!r}")
        others[name] = int(value)
    args.others = others
    try:
        args.grid = settings_grid(args.sel_block, args.n_selected, others)
        args.launch_overrides = launch_overrides(args.launch)
    except ValueError as e:
        ap.error(str(e))
    return args


def setting_label(cfg: NSAConfig) -> str:
    return f"l'={cfg.sel_block} n={cfg.n_selected}"


def check_ranges(T: int) -> tuple[tuple[int, int], ...]:
    """The first, middle and last CHECK_QUERIES queries of T, overlapping ones merged (check_bf16 takes disjoint
    ranges)."""
    c = min(CHECK_QUERIES, T)
    ranges = []
    for start in sorted({0, max(0, T // 2 - c // 2), T - c}):
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], start + c)
        else:
            ranges.append((start, start + c))
    return tuple(ranges)


def markdown(meta: dict, rows: list[dict], shapes: list, grid: list[NSAConfig]) -> str:
    """Per shape, a table of NSA ms and NSA / cuDNN with l' down and n across, then each setting's check."""
    lines = [f"# NSA settings: the core's fwd+bwd against dense cuDNN, {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, bf16, CUDA graphs (median of "
             f"triton.testing.do_bench). Other NSA fields: {meta['nsa_fields']}.", ""]
    sel_blocks = sorted({c.sel_block for c in grid})
    ns = sorted({c.n_selected for c in grid})
    for family, B, T in shapes:
        shape_rows = [r for r in rows if (r["family"], r["B"], r["T"]) == (family, B, T)]
        dense = next((r for r in shape_rows if r.get("kind") == "dense"), None)
        lines += [f"## {family} {B} x {T}", ""]
        if dense is None or "error" in dense:
            lines += [f"dense cuDNN failed: {(dense or {}).get('error', 'not run')}", ""]
        else:
            lines += [f"dense cuDNN {dense['cudnn_ms']:.2f} ms (before the grid {dense['cudnn_before_ms']:.2f}, "
                      f"after {dense['cudnn_after_ms']:.2f}).", ""]
        lines += ["NSA ms (NSA / cuDNN) [selected variant]:", "",
                  "| l' \\ n | " + " | ".join(str(n) for n in ns) + " |", "|---" * (len(ns) + 1) + "|"]
        by_setting = {(r["sel_block"], r["n_selected"]): r for r in shape_rows if r.get("kind") == "nsa"}
        for sel_block in sel_blocks:
            cells = []
            for n in ns:
                r = by_setting.get((sel_block, n))
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("error")
                else:
                    ratio = f" ({r['ratio']:.3f})" if r.get("ratio") is not None else ""
                    cells.append(f"{r['nsa_ms']:.2f}{ratio} [{r['variant']}]")
            lines.append(f"| {sel_block} | " + " | ".join(cells) + " |")
        lines += ["", "| setting | check: worst rel err (o, grads) | selection rows differing (near-ties) | ok |",
                  "|---|---|---|---|"]
        for (sel_block, n), r in sorted(by_setting.items()):
            c = r.get("check")
            if c is None:
                lines.append(f"| l'={sel_block} n={n} | {r.get('error', 'not checked')[:100]} | - | - |")
                continue
            lines.append(f"| l'={sel_block} n={n} | {c.get('worst', float('nan')):.2e} | "
                         f"{c.get('selection_rows_differing', '-')} ({c.get('selection_near_ties', '-')}) | "
                         f"{'yes' if c.get('ok') else 'NO'} |")
        profiled = [(key, r["kernel_ms"]) for key, r in sorted(by_setting.items()) if "kernel_ms" in r]
        if profiled:
            lines += ["", "GPU ms per kernel of one fwd+bwd (torch.profiler, eager), largest first:", ""]
            lines += [f"- l'={sel_block} n={n}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in kernels.items())
                      for (sel_block, n), kernels in profiled]
        lines.append("")
    return "\n".join(lines)


def plot(path, rows: list[dict], shapes: list, grid: list[NSAConfig]) -> None:
    """One heatmap of NSA / cuDNN per shape, l' down and n across, each cell written in."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sel_blocks = sorted({c.sel_block for c in grid})
    ns = sorted({c.n_selected for c in grid})
    fig, axes = plt.subplots(1, len(shapes), figsize=(1.2 + 1.6 * len(ns) * len(shapes), 1.5 + 0.8 * len(sel_blocks)),
                             squeeze=False)
    for ax, (family, B, T) in zip(axes[0], shapes):
        ratio = np.full((len(sel_blocks), len(ns)), np.nan)
        for r in rows:
            if (r["family"], r["B"], r["T"], r.get("kind")) == (family, B, T, "nsa") and r.get("ratio") is not None:
                ratio[sel_blocks.index(r["sel_block"]), ns.index(r["n_selected"])] = r["ratio"]
        image = ax.imshow(ratio, cmap="viridis_r", aspect="auto")
        middle = np.nanmean([np.nanmin(ratio), np.nanmax(ratio)]) if not np.isnan(ratio).all() else 0.0
        for i, j in itertools.product(range(len(sel_blocks)), range(len(ns))):
            if not np.isnan(ratio[i, j]):  # dark text on the map's light (low) end
                ax.text(j, i, f"{ratio[i, j]:.2f}", ha="center", va="center", fontsize=9,
                        color="black" if ratio[i, j] < middle else "white")
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_yticks(range(len(sel_blocks)), [str(s) for s in sel_blocks])
        ax.set_xlabel("n (selected blocks)")
        ax.set_ylabel("l' (selection block)")
        ax.set_title(f"{family} {B} x {T}: NSA / cuDNN")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_shape(kb, family: str, B: int, T: int, grid: list[NSAConfig], skip_checks: bool,
              profile: bool = False) -> list[dict]:
    """Rows of one shape: dense cuDNN (timed before and after the grid), then each setting's check and time."""
    import torch

    s = kb.SHAPES[family]
    H, G, Dk, Dv = s["H"], s["G"], s["Dk"], s["Dv"]
    base = {"family": family, "B": B, "T": T}
    # Tc of the inputs' compressed tokens depends on l and d only, which every setting of the grid shares (--nsa
    # fixes them for the whole run), so one input set serves every (l', n)
    x = {n: t.requires_grad_() for n, t in kb.make_inputs(B, T, H, G, Dk, Dv, grid[0], torch.bfloat16,
                                                          seed=1).items()}
    do = torch.randn(B, T, H, Dv, device="cuda", dtype=torch.bfloat16)
    dense_fb, dense_leaves = kb.dense_call(x, do, H // G, "cudnn")
    before = kb.bench_graph(dense_fb, dense_leaves)
    rows = []
    for cfg in grid:
        row = {**base, "kind": "nsa", "sel_block": cfg.sel_block, "n_selected": cfg.n_selected}
        start = time.time()
        try:
            row["variant"] = kb.ti.attended_kernel(H // G, T, cfg.sel_block, cfg.n_selected)
            if not skip_checks:
                check = kb.check_bf16(setting_label(cfg), B, T, H, G, Dk, Dv, cfg, query_ranges=check_ranges(T))
                errors = [v for k, v in check.items() if k == "o" or (k.startswith("d") and k[1:] in kb.NAMES)]
                row["check"] = {"worst": max(errors), **{k: check[k] for k in (
                    "ok", "finite", "queries_checked", "selection_rows_differing", "selection_near_ties")}}
                torch.cuda.empty_cache()
            leaves = list(x.values())

            def nsa_fb(cfg=cfg):
                kb.ti.nsa_attention(*leaves, cfg, scale=Dk ** -0.5).backward(do)
            row["nsa_ms"] = kb.bench_graph(nsa_fb, leaves)
            if profile:
                row["kernel_ms"] = kb.kernel_breakdown(kb.fresh_grads(nsa_fb, leaves), top=8)
        except Exception as e:  # recorded in the row; the other settings still run
            traceback.print_exc()
            row["error"] = repr(e)[:300]
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    after = kb.bench_graph(dense_fb, dense_leaves)
    cudnn = statistics.mean([before, after])
    for row in rows:
        if "nsa_ms" in row:
            row["ratio"] = row["nsa_ms"] / cudnn
    dense = {**base, "kind": "dense", "cudnn_ms": cudnn, "cudnn_before_ms": before, "cudnn_after_ms": after}
    print(json.dumps(dense), flush=True)
    return [dense] + rows


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/nsa_settings.py needs a CUDA GPU")
    import bench.kernels as kb

    if args.launch_overrides:
        kb.ti.set_launch_config(dataclasses.replace(kb.ti.launch_config(), **args.launch_overrides))
    stem, meta = result_stem(args.out, "nsa-settings", args.suffix, args.commit or git_commit())
    meta.update(nsa_fields={k: getattr(args.grid[0], k) for k in OTHER_FIELDS},
                launch_config=kb.ti.launch_config().__dict__)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for family, B, T in args.shapes:
        try:
            rows += run_shape(kb, family, B, T, args.grid, args.skip_checks, args.profile)
        except Exception as e:
            traceback.print_exc()
            rows.append({"family": family, "B": B, "T": T, "kind": "dense", "error": repr(e)[:300]})
        torch.cuda.empty_cache()
        result_file(stem, ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(meta, rows, args.shapes, args.grid)
    result_file(stem, ".md").write_text(text)
    plot(result_file(stem, ".png"), rows, args.shapes, args.grid)
    print(text)


if __name__ == "__main__":
    main()
