"""Probe: whether two of NSA's forward kernels overlap when they run on two CUDA streams at once.

    python bench/probe_overlap.py [--shapes paper:1:32768,paper:1:65536] --out DIR --commit SHA [--suffix=-v62g]

The forward runs its pieces one after another on one stream (the window forward aside): the compressed forward
(bound by the matrix units), then the selection, then the per-query selected forward (bound by the L2's
throughput, kernels-notes v61). A forward cut into query chunks could run one chunk's selected forward beside the
next chunk's compressed forward. That pays only if the two kernels, launched together, take less than one after
the other. This times each piece alone and each pair both ways, as CUDA graphs (median ms of replays): "serial"
on one stream, "beside" on two (a fork and a join in the graph). Timing only; the pieces read inputs from
bench/kernels.py's make_inputs and the blocks NSA's own selection picks. Writes
DIR/probe-overlap-<device>-<date><suffix>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, result_file, result_stem  # noqa: E402
from bench.shapes import FAMILIES, family_shapes  # noqa: E402

PAIRS = (("cmp fwd", "slc fwd"), ("selection", "slc fwd"), ("cmp fwd", "selection"), ("win fwd", "slc fwd"))


def pieces(ti, x, cfg, T: int, scale: float) -> tuple[dict, dict]:
    """(closures, outputs): the forward's pieces as closures over preallocated outputs, each writing only its own,
    and those outputs (o and lse of the three attention pieces, the blocks the per-query forward reads)."""
    import torch

    q = x["q"].contiguous()
    k_cmp, v_cmp = ti._kv_rows(x["k_cmp"]), ti._kv_rows(x["v_cmp"])
    k_slc, v_slc = ti._kv_rows(x["k_slc"]), ti._kv_rows(x["v_slc"])
    k_win, v_win = ti._kv_rows(x["k_win"]), ti._kv_rows(x["v_win"])
    cmp_range, win_range = ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), ti._win_range(cfg.window, T)
    o_cmp, lse_cmp = ti._range_outputs(q, v_cmp)
    o_win, lse_win = ti._range_outputs(q, v_win)
    ti._range_fwd_into(q, k_cmp, v_cmp, o_cmp, lse_cmp, T, *cmp_range, scale)
    lse_sel = lse_cmp.clone()  # the selection's own copy: the compressed forward may rewrite lse_cmp beside it
    blocks = ti.select_blocks(q, k_cmp, lse_sel, cfg, scale)
    common = ti._selected_common(q, k_slc, v_slc, cfg.sel_block, cfg.n_selected)
    o_slc, lse_slc = torch.empty_like(o_cmp), torch.empty_like(lse_cmp)
    fns = {
        "cmp fwd": lambda: ti._range_fwd_into(q, k_cmp, v_cmp, o_cmp, lse_cmp, T, *cmp_range, scale),
        "win fwd": lambda: ti._range_fwd_into(q, k_win, v_win, o_win, lse_win, T, *win_range, scale),
        "selection": lambda: ti.select_blocks(q, k_cmp, lse_sel, cfg, scale),
        "slc fwd": lambda: ti._per_query_fwd(q, k_slc, v_slc, blocks, o_slc, lse_slc, common, scale),
    }
    return fns, {"cmp": (o_cmp, lse_cmp), "win": (o_win, lse_win), "slc": (o_slc, lse_slc), "blocks": blocks}


def serial(a, b):
    def run():
        a()
        b()
    return run


def beside(a, b):
    """a on the current stream and b on a second one, forked from it and joined back (capturable)."""
    import torch

    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        a()
        with torch.cuda.stream(side):
            b()
        main.wait_stream(side)
    return run


def markdown(meta: dict, rows: dict) -> str:
    lines = [f"# Probe: NSA forward pieces beside each other, {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, bf16. CUDA graphs, median "
             "ms. serial: one stream; beside: two streams. gain: serial - beside.", ""]
    for name, row in rows.items():
        lines += [f"## {name}", "", "| piece | ms |", "|---|---|"]
        lines += [f"| {p} | {ms:.3f} |" for p, ms in row["alone"].items()]
        lines += ["", "| pair | serial | beside | gain | gain / shorter piece |", "|---|---|---|---|---|"]
        for pair, t in row["pairs"].items():
            a, b = pair.split(" + ")
            shorter = min(row["alone"][a], row["alone"][b])
            lines.append(f"| {pair} | {t['serial']:.3f} | {t['beside']:.3f} | {t['serial'] - t['beside']:.3f} | "
                         f"{(t['serial'] - t['beside']) / shorter:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=family_shapes, default="paper:1:32768,paper:1:65536")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import json

    import torch

    from bench import kernels as kb

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_overlap.py needs a CUDA GPU")
    ti, cfg = kb.ti, kb.PAPER_NSA
    rows = {}
    for family, B, T in args.shapes:
        f = FAMILIES[family]
        x = kb.make_inputs(B, T, f["H"], f["G"], f["D"], f["D"], cfg, torch.bfloat16, seed=1)
        with torch.no_grad():
            fns, _ = pieces(ti, x, cfg, T, f["D"] ** -0.5)
            alone = {p: kb.bench_graph(fn) for p, fn in fns.items()}
            pairs = {}
            for a, b in PAIRS:
                pairs[f"{a} + {b}"] = {"serial": kb.bench_graph(serial(fns[a], fns[b])),
                                       "beside": kb.bench_graph(beside(fns[a], fns[b]))}
        name = f"{family} {B} x {T}"
        rows[name] = {"alone": alone, "pairs": pairs}
        print(name, alone, pairs, flush=True)
    stem, meta = result_stem(args.out, "probe-overlap", args.suffix, args.commit)
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "ms": rows}, indent=1))
    table = markdown(meta, rows)
    result_file(stem, ".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
