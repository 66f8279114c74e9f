"""What the compiled training forward keeps for the backward, per layer, NSA against dense, at real shapes, on a CPU.

    python bench/saved_activations.py --preset nsa-125m --seq-lens 2048,8192,32768 [--micro-tokens 32768] \
        [--recompute nsa[,dense]]

torch.compile traces the model under bf16 autocast with fake tensors. AOT autograd splits the graph the way
inductor does (inductor's decompositions, the min-cut partitioner). The forward graph's outputs beyond the loss
are the tensors saved for the backward. Their bytes are summed, each storage once (views of one tensor count
once; the graph's inputs, parameters among them, not at all: they are in memory anyway), for a model of one
layer and one of two. The difference is one layer's share; the rest belongs to the
embedding and the head. The compiler then stops before anything runs, so no kernel executes and the 125M model at
T = 32768 takes seconds.

Under CUDA graphs these activations live in the graphs' pool, the largest part of a step's reserved memory, so
NSA minus dense per layer, times the layers, predicts most of the gap between their peaks (v13 in
bench/results/kernels-notes.md). Writes bench/results/saved-activations-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import file_suffix, git_commit, result_file  # noqa: E402
from nsa_model import Transformer, get_preset  # noqa: E402


class _Traced(Exception):
    """Raised by the forward compiler once it has read the graph: nothing compiles or runs after that."""


@dataclasses.dataclass
class Saved:
    total_bytes: int
    by_site: dict[str, int]  # "op shape dtype" of the first tensor seen on each storage -> its storage's bytes


def saved_for_backward(model: torch.nn.Module, tokens: torch.Tensor) -> Saved:
    """The storages the compiled forward outputs besides its own results, for one forward on tokens [B, T]."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    found: dict[str, Saved] = {}

    def forward_compiler(gm, example_inputs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        storages: dict[int, int] = {}
        by_site: collections.Counter = collections.Counter()
        for node in outputs:
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or value.dim() == 0:  # the loss, symbolic sizes
                continue
            if node.op == "placeholder":  # a parameter, buffer or input: in memory whether saved or not
                continue
            storage = value.untyped_storage()
            if storage._cdata in storages:
                continue
            storages[storage._cdata] = storage.nbytes()
            op = str(node.target) if node.op == "call_function" else node.op
            by_site[f"{op} {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"] += storage.nbytes()
        found["saved"] = Saved(sum(storages.values()), dict(by_site))
        raise _Traced

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=forward_compiler,
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(tokens, tokens)
    except Exception as e:  # dynamo wraps what a backend raises
        if "saved" not in found:
            raise
        del e
    return found["saved"]


def _model(preset: str, seq_len: int, layers: int, recompute: bool) -> torch.nn.Module:
    cfg = get_preset(preset).replace(max_seq_len=seq_len, n_layers=layers)
    with torch.device("meta"):  # parameters without memory; to_empty gives them (uninitialised) CPU storage
        model = Transformer(cfg, backend="triton" if cfg.attention == "nsa" else "auto",
                            attention_recompute=recompute)
    return model.to_empty(device="cpu")


def per_layer(preset: str, seq_len: int, batch: int, recompute: bool = False) -> dict:
    """Saved bytes of one layer (2-layer model minus 1-layer model) and of the rest, with the per-layer sites;
    recompute: the model's attention_recompute. An NSA preset needs the Triton backend importable for CPU
    tensors (TRITON_INTERPRET=1 before its import)."""
    from nsa_model.ops import triton_impl

    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    with triton_impl.use_launch_config(triton_impl.LaunchConfig()):  # the GPU's config (index sizes follow it)
        one, two = (saved_for_backward(_model(preset, seq_len, n, recompute), tokens) for n in (1, 2))
    sites = collections.Counter(two.by_site)
    sites.subtract(one.by_site)
    return {"preset": preset, "seq_len": seq_len, "batch": batch, "recompute": recompute,
            "layer_bytes": two.total_bytes - one.total_bytes,
            "rest_bytes": 2 * one.total_bytes - two.total_bytes,
            "layer_sites": dict(sorted(((k, v) for k, v in sites.items() if v), key=lambda kv: -kv[1]))}


def markdown(meta: dict, rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = [f"# Saved activations per layer, NSA vs dense (traced on the CPU), {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, preset {meta['preset']} ({meta['layers']} layers), "
             f"micro-batches of {meta['micro_tokens']} tokens, bf16 autocast; inductor's decompositions and min-cut "
             "partitioner. Bytes of the tensors the compiled forward saves for the backward (each storage once). "
             f"attention_recompute: {', '.join(meta.get('recompute') or []) or 'neither model'}.", "",
             "| T | batch | NSA MiB / layer | dense MiB / layer | NSA - dense per layer | x layers | NSA / dense, "
             "all layers |", "|---|---|---|---|---|---|---|"]
    by_t: dict[int, dict] = {}
    for r in rows:
        by_t.setdefault(r["seq_len"], {})[r["attention"]] = r
    for t, pair in sorted(by_t.items()):
        nsa, dense = pair["nsa"], pair["dense"]
        gap = nsa["layer_bytes"] - dense["layer_bytes"]
        lines.append(f"| {t} | {nsa['batch']} | {nsa['layer_bytes'] / mib:,.1f} | {dense['layer_bytes'] / mib:,.1f} | "
                     f"{gap / mib:+,.1f} | {gap * meta['layers'] / mib:+,.0f} | "
                     f"{nsa['layer_bytes'] / dense['layer_bytes']:.3f} |")
    for t, pair in sorted(by_t.items()):
        lines += ["", f"## T={t}: one layer's saved tensors (MiB; the op and shape of the first view of each storage)",
                  "", "| tensor | NSA | dense |", "|---|---|---|"]
        nsa, dense = pair["nsa"]["layer_sites"], pair["dense"]["layer_sites"]
        for site in sorted(set(nsa) | set(dense), key=lambda s: -max(nsa.get(s, 0), dense.get(s, 0)))[:16]:
            lines.append(f"| `{site}` | {nsa.get(site, 0) / mib:,.1f} | {dense.get(site, 0) / mib:,.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nsa-125m")
    ap.add_argument("--seq-lens", default="2048,8192,32768")
    ap.add_argument("--micro-tokens", type=int, default=32768, help="tokens per micro-batch (batch = this / T)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--recompute", default="", help="comma-separated: the models (nsa, dense) traced with "
                                                     "attention_recompute")
    args = ap.parse_args()
    recompute = [x for x in args.recompute.split(",") if x]
    if set(recompute) - {"nsa", "dense"}:
        raise SystemExit(f"--recompute: unknown {sorted(set(recompute) - {'nsa', 'dense'})}; use nsa, dense")
    # The Triton backend checks that its inputs can run: CUDA tensors, or CPU ones under Triton's interpreter.
    # Nothing runs here (the tracing uses fake tensors), but the check must pass on CPU tensors, so the
    # interpreter's switch is set before the backend is first imported.
    os.environ["TRITON_INTERPRET"] = "1"
    rows = []
    for t in (int(x) for x in args.seq_lens.split(",")):
        for attention, preset in (("nsa", args.preset), ("dense", f"{args.preset}-dense")):
            row = per_layer(preset, t, max(1, args.micro_tokens // t), attention in recompute)
            rows.append({"attention": attention, **row})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "layer_sites"}), flush=True)
    now = dt.datetime.now(dt.timezone.utc)
    meta = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(), "torch": torch.__version__,
            "preset": args.preset, "layers": get_preset(args.preset).n_layers, "micro_tokens": args.micro_tokens,
            "recompute": recompute}
    stem = Path(args.out) / f"saved-activations-{now.strftime('%Y-%m-%d')}{args.suffix}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    result_file(stem, ".md").write_text(markdown(meta, rows))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
