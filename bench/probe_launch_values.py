"""Probe: values of one integer, bool or tile LaunchConfig field against its first, in the whole NSA forward + backward.

    python bench/probe_launch_values.py --field range_dkdv_q_chunk --values 4096,0,8192
                                        [--kernels range_attn_bwd_dkdv_kernel,selected_block_bwd_kernel]
                                        [--shapes paper:1:8192,paper:1:65536] [--rounds 2]
                                        [--launch NAME=VALUE ...]
                                        --out DIR --commit SHA [--suffix=-v58b]
    python bench/probe_launch_values.py --field range_dq --values "(64,64,4,2),(64,64,4,3)" ...

The first value is the judge (the default's path, checked against float64 by bench/kernels.py): before timing,
each value's eight gradients must agree with its within 1e-2 of their norm (atomic adds may meet in another
order), or the probe stops. Then, `rounds` times over the values in turn (drift shows as a spread between
rounds): the NSA forward + backward replayed as a CUDA graph (median ms, as training runs it) and the GPU time of
each named kernel in one call (torch.profiler). --launch changes other fields of the default LaunchConfig under
every value (bench/launch.py's syntax, as bench/kernels.py takes it; v58's runs named it --set). Writes
DIR/probe-<device>-<date><suffix>.json and .md.

v57 ran this as bench/probe_dkdv_chunks.py, the field fixed to range_dkdv_q_chunk and the kernel to the range
dK/dV: `--field range_dkdv_q_chunk --values 0,2048,4096,8192,16384 --kernels range_attn_bwd_dkdv_kernel`. v58
ran it at 6eceb54 for by_block's index cut by query chunk (slc_block_q_chunk) and at 74d9a59 for the compressed
dK/dV's dK and dV by separate programs (range_dkdv_split_parts); both lost and were removed (kernels-notes v58).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.launch import launch_overrides  # noqa: E402
from bench.provenance import file_suffix, git_commit, result_file  # noqa: E402
from bench.shapes import FAMILIES, family_shapes  # noqa: E402


def value_list(text: str) -> list:
    """Comma-separated integers (0,4096) or tuples of integers, a tile field's values ((64,64,4,2),(64,64,4,3))."""
    try:
        values = ast.literal_eval(f"[{text}]")
    except (ValueError, SyntaxError):
        values = None
    ok = isinstance(values, list) and values and all(
        type(v) is int or (isinstance(v, tuple) and v and all(type(x) is int for x in v)) for v in values)
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,4096, or tuples of "
                                         "them, e.g. (64,64,4,2),(64,64,4,3)") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: a value appears twice")
    return values


def name_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated kernel names")
    return names


def base_config(default, items: list[str]):
    """The default LaunchConfig with the --launch NAME=VALUE items (bench/launch.py), refused before any GPU work
    where a name is not a field or a value is invalid (LaunchConfig validates)."""
    try:
        return dataclasses.replace(default, **launch_overrides(items))
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--launch: {err}") from None


def launch_configs(base, field: str, values: list) -> dict:
    """{value: base with field = value (a bool field: 0 or 1 as False or True)}, refused before any GPU work where
    the field is not an integer, bool or tile (tuple) field of LaunchConfig or a value is not valid for it
    (LaunchConfig validates each)."""
    names = sorted(f.name for f in dataclasses.fields(base) if isinstance(getattr(base, f.name), (int, tuple)))
    if field not in names:
        raise SystemExit(f"--field {field!r}: not an integer, bool or tile LaunchConfig field; one of "
                         f"{', '.join(names)}")
    if any(isinstance(v, tuple) != isinstance(getattr(base, field), tuple) for v in values):
        raise SystemExit(f"--values: {field} takes {'tuples' if isinstance(getattr(base, field), tuple) else 'ints'}"
                         f", got {values}")
    if isinstance(getattr(base, field), bool):
        if not set(values) <= {0, 1}:
            raise SystemExit(f"--values: {field} is a bool: 0 or 1, got {values}")
        values = [bool(v) for v in values]
    try:
        return {v if isinstance(v, tuple) else int(v): dataclasses.replace(base, **{field: v}) for v in values}
    except ValueError as err:
        raise SystemExit(f"--values: {err}") from None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--field", required=True)
    ap.add_argument("--values", type=value_list, required=True)
    ap.add_argument("--kernels", type=name_list, default=name_list("range_attn_bwd_dkdv_kernel"))
    ap.add_argument("--shapes", type=family_shapes, default="paper:1:8192,paper:1:65536")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch

    from bench import kernels as kb
    from bench.kernel_variants import write_times

    ti = kb.ti
    base = base_config(ti.launch_config(), args.launch)
    configs = launch_configs(base, args.field, args.values)
    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_launch_values.py needs a CUDA GPU")
    cfg = kb.PAPER_NSA
    judge = args.values[0]
    results = {}
    for family, B, T in args.shapes:
        f = FAMILIES[family]
        H, G, D = f["H"], f["G"], f["D"]
        x = kb.make_inputs(B, T, H, G, D, D, cfg, torch.bfloat16, seed=1)
        leaves = [x[n].requires_grad_() for n in kb.NAMES]
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16,
                         generator=torch.Generator("cuda").manual_seed(2))
        name = f"{family} {B} x {T}"

        def nsa_fb():
            ti.nsa_attention(*leaves, cfg, scale=D ** -0.5).backward(do)

        # the agreement check on leaves of its own: a backward run eagerly on the timed leaves leaves their
        # gradient streams tied to the default stream, and the graph capture below then fails (v48)
        check_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        grads = {}
        for v, launch in configs.items():
            with ti.use_launch_config(launch):
                o = ti.nsa_attention(*check_leaves, cfg, scale=D ** -0.5)
                grads[v] = torch.autograd.grad(o, check_leaves, do)
        for v in args.values:
            for n, got, want in zip(kb.NAMES, grads[v], grads[judge]):
                err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
                if not err <= 1e-2:
                    raise SystemExit(f"{name}: {args.field} {v}: d{n} differs from {judge}'s by {err:.3g}")
        del grads, check_leaves
        for r in range(args.rounds):
            for v, launch in configs.items():
                with ti.use_launch_config(launch):
                    graph_ms = kb.bench_graph(nsa_fb, leaves)
                    per_kernel = kb.kernel_breakdown(kb.fresh_grads(nsa_fb, leaves), top=40)
                results.setdefault(f"graph ms, {v}, round {r + 1}", {})[name] = graph_ms
                line = f"{name} {args.field} {v} round {r + 1}: NSA graph {graph_ms:.3f} ms"
                for kernel in args.kernels:
                    ms = per_kernel.get(kernel, 0.0)
                    results.setdefault(f"{kernel} ms, {v}, round {r + 1}", {})[name] = ms
                    line += f", {kernel} {ms:.3f} ms"
                print(line, flush=True)
        torch.cuda.empty_cache()
    settings = f" (with {', '.join(args.launch)})" if args.launch else ""
    stem = write_times(args.out, args.suffix, args.commit or git_commit(), results,
                       title=f"LaunchConfig.{args.field}: {', '.join(map(str, args.values))}{settings}",
                       note=f"Each value of {args.field}{settings}, the first the judge of the others' gradients "
                            "(within 1e-2). NSA fwd+bwd as a CUDA graph (median ms) and each named kernel's GPU ms in "
                            "one call (torch.profiler).",
                       unit="ms", fmt=".3f")
    print(result_file(stem, ".md").read_text())


if __name__ == "__main__":
    main()
