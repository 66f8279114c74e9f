"""Probe (not a check): how NSA's selections change as a model trains, and what that does to the selected branch.

    python bench/probe_selection.py --steps 0,100,200,400 [--preset nsa-125m --seq-len 8192 --batch 4]
                                    --out DIR [--commit SHA] [--suffix=-v38]

The kernel benchmarks and the throughput runs see selections of random inputs or of a model at initialization,
where a query's chosen blocks are close to random and its neighbours choose apart. The tiled selected kernels do
work in proportion to the union of a tile's choices (kernels/selected_tiled.py), by_block in proportion to the
choices themselves (kernels/selected_by_block.py), so which is faster depends on how much neighbouring queries
share. This trains the preset from initialization (AdamW, bf16 autocast on CUDA, linear warm-up then a constant
learning rate) on byte tokens of the embedded corpus, and at each step of --steps records for every layer, from
that layer's own selections of a fixed held-out batch:

- union: blocks in the union of a tile's queries' choices, over n (tile = the tiled kernels' tile_q neighbouring
  queries of one kv group; 1.0: every query of the tile chose the same blocks; tile_q: all distinct);
- shared: the fraction of a query's chosen blocks that the query before it also chose.

On CUDA it also times the selected branch alone (forward, and forward + backward) on some layers' own q, k, v and
selections, under `by_block` and `tiled_by_block` (triton.testing.do_bench medians). Writes
DIR/probe-selection-<device>-<date><suffix>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit, result_stem  # noqa: E402

VARIANTS = ("by_block", "tiled_by_block")


def parse_steps(text: str) -> list[int]:
    """--steps: ascending, distinct, non-negative integers."""
    try:
        steps = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,100,400") from None
    if not steps or min(steps) < 0 or steps != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"{text!r}: steps must be distinct, ascending and >= 0")
    return steps


def union_ratio(blocks, tile_q: int):
    """Mean over (batch, tile, group) of |union of the tile's choices| / n, for blocks [B, T, G, n] (-1 = none).
    Tiles are tile_q consecutive queries; a partial last tile counts as it is. Tiles with no choice are left out."""
    import torch

    B, T, G, n = blocks.shape
    pad = -T % tile_q
    if pad:
        blocks = torch.cat([blocks, blocks.new_full((B, pad, G, n), -1)], dim=1)
    per_tile = blocks.view(B, -1, tile_q, G, n).permute(0, 1, 3, 2, 4).reshape(B, -1, G, tile_q * n)
    ids = per_tile.sort(-1).values  # -1 (none) first, so every change of value along a row is to a new block
    distinct = (ids[..., :1] >= 0).sum(-1) + (ids[..., 1:] != ids[..., :-1]).sum(-1)
    chosen = distinct > 0
    return float(distinct[chosen].double().mean() / n) if chosen.any() else float("nan")


def shared_with_previous(blocks) -> float:
    """Mean over queries t >= 1 (with a choice) of the fraction of t's chosen blocks that t - 1 also chose."""
    cur, prev = blocks[:, 1:], blocks[:, :-1]
    valid = cur >= 0
    hit = (cur[..., :, None] == prev[..., None, :]).any(-1) & valid
    count = valid.sum(-1)
    rows = count > 0
    if not rows.any():
        return float("nan")
    return float((hit.sum(-1)[rows].double() / count[rows]).mean())


def batches(corpus, batch: int, seq_len: int, gen):
    """Endless random windows of seq_len + 1 byte tokens: (inputs, targets) [batch, seq_len]."""
    import torch

    while True:
        starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=gen)
        rows = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()]).long()
        yield rows[:, :-1], rows[:, 1:]


def corpus_bytes(min_tokens: int):
    """The embedded corpus's documents as UTF-8 bytes, each followed by a 0 byte (a document separator)."""
    import torch

    from pipeline.data.corpus import documents
    from pipeline.data.corpus_sources import SkipCounter

    data = bytearray()
    for row in documents("stdlib", SkipCounter()):
        data += row["text"].encode("utf-8") + b"\0"
    if len(data) < min_tokens:
        raise SystemExit(f"embedded corpus: {len(data)} bytes, fewer than the {min_tokens} tokens of one batch")
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def layer_inputs(model, tokens) -> list:
    """[(q, k_slc, v_slc, blocks)] of one forward over tokens, one per NSA layer in order: the selected branch's
    inputs and the layer's selections, as each layer hands them to ops.nsa_attention (caught there, so nothing is
    projected twice and the key/value sets are the layer's own)."""
    from unittest import mock

    import torch

    from nsa_model import ops

    captured, real = [], ops.nsa_attention

    def spy(q, k_slc, v_slc, *args, **kwargs):
        o, blocks = real(q, k_slc, v_slc, *args, **kwargs)  # NSAAttention asks for return_blocks=True
        captured.append((q, k_slc, v_slc, blocks))
        return o, blocks

    with mock.patch.object(ops, "nsa_attention", spy), torch.no_grad():
        model(tokens)
    return captured


def time_variants(q, k, v, blocks, nsa, scale: float) -> dict:
    """{variant: {"fwd_ms", "fwd_bwd_ms"}} of the selected branch on these inputs (CUDA only)."""
    import torch
    import triton.testing

    from nsa_model.ops import triton_impl as ti

    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    do = torch.randn(*q.shape[:3], v.shape[-1], device=q.device, dtype=q.dtype)
    out = {}
    for name in VARIANTS:
        with ti.use_launch_config(dataclasses.replace(ti.launch_config(), slc_kernel=name)):
            def fwd():
                with torch.no_grad():
                    ti.selected_attention(q, k, v, blocks, nsa, scale)

            def fwd_bwd():
                o = ti.selected_attention(q, k, v, blocks, nsa, scale)
                torch.autograd.grad(o, (q, k, v), do)
            out[name] = {"fwd_ms": triton.testing.do_bench(fwd), "fwd_bwd_ms": triton.testing.do_bench(fwd_bwd)}
    return out


def tile_queries(hpg: int) -> int:
    from nsa_model.ops import triton_impl as ti

    return ti._selected_tile(hpg)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nsa-125m")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=parse_steps, default=[0, 100, 200, 400])
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup-steps", type=int, default=50, help="linear learning-rate warm-up")
    ap.add_argument("--timed-layers", default="0,5,11", help="layers whose selected branch is timed (CUDA)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch

    from nsa_model import Transformer, get_preset

    cfg = get_preset(args.preset)
    if cfg.attention != "nsa":
        raise SystemExit(f"--preset {args.preset}: not an NSA model")
    if args.seq_len > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=args.seq_len)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    timed = sorted({int(x) for x in args.timed_layers.split(",")} & set(range(cfg.n_layers))) if cuda else []
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    corpus = corpus_bytes(args.batch * (args.seq_len + 1))
    gen = torch.Generator().manual_seed(0)
    held_out = next(batches(corpus, args.batch, args.seq_len, torch.Generator().manual_seed(1)))[0].to(device)
    stream = batches(corpus, args.batch, args.seq_len, gen)
    hpg = cfg.n_heads // cfg.n_kv_heads
    tile_q = tile_queries(hpg)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cuda)
    records, step, loss, t0 = [], 0, float("nan"), time.time()
    for target in args.steps:
        while step < target:
            x, y = (t.to(device, non_blocking=True) for t in next(stream))
            with autocast:
                _, loss_t = model(x, y)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == target:
                loss = float(loss_t.detach())
        model.eval()
        with autocast:
            captured = layer_inputs(model, held_out)
        if len(captured) != cfg.n_layers:
            raise RuntimeError(f"caught {len(captured)} calls of ops.nsa_attention in a {cfg.n_layers}-layer model")
        model.train()
        layers = []
        for i in range(cfg.n_layers):
            q, k, v, blocks = captured[i]
            row = {"layer": i, "union": union_ratio(blocks, tile_q), "shared": shared_with_previous(blocks)}
            if i in timed:
                row["times"] = time_variants(q, k, v, blocks, cfg.nsa, cfg.head_dim ** -0.5)
            layers.append(row)
        records.append({"step": step, "train_loss": loss, "seconds": round(time.time() - t0, 1), "layers": layers})
        mean_union = sum(r["union"] for r in layers) / len(layers)
        print(f"step {step}: loss {loss:.3f}, mean union {mean_union:.2f} n, "
              f"shared {sum(r['shared'] for r in layers) / len(layers):.3f}", flush=True)
    write(args, cfg, tile_q, records)


def write(args, cfg, tile_q: int, records: list) -> None:
    commit = args.commit or git_commit()
    stem, meta = result_stem(args.out, "probe-selection", args.suffix, commit)
    stem.parent.mkdir(parents=True, exist_ok=True)
    name = meta["device"]
    result = {**meta, "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr,
              "warmup_steps": args.warmup_steps, "tile_q": tile_q, "n_selected": cfg.nsa.n_selected,
              "records": records}
    with open(f"{stem}.json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Selections as {args.preset} trains: {name}", "",
             f"{meta['date']}, commit {commit}, B x T = {args.batch} x {args.seq_len}, byte tokens of the embedded "
             f"corpus, AdamW lr {args.lr} ({args.warmup_steps} warm-up steps); union: distinct blocks of a tile of {tile_q} "
             f"queries over n = {cfg.nsa.n_selected} (1 = all shared, {tile_q} = all distinct); shared: fraction of a "
             "query's blocks the query before it chose too.", "",
             "| step | train loss | mean union | min / max union over layers | mean shared |",
             "|---|---|---|---|---|"]
    for r in records:
        u = [x["union"] for x in r["layers"]]
        s = [x["shared"] for x in r["layers"]]
        lines.append(f"| {r['step']} | {r['train_loss']:.3f} | {sum(u) / len(u):.2f} | {min(u):.2f} / {max(u):.2f} "
                     f"| {sum(s) / len(s):.3f} |")
    timed = [(r["step"], x) for r in records for x in r["layers"] if "times" in x]
    if timed:
        lines += ["", "Selected branch alone on the layer's own inputs (ms, do_bench medians):", "",
                  "| step | layer | union | " + " | ".join(f"{v} fwd | {v} fwd+bwd" for v in VARIANTS) + " |",
                  "|---|---|---|" + "---|---|" * len(VARIANTS)]
        for step, x in timed:
            cells = " | ".join(f"{x['times'][v]['fwd_ms']:.3f} | {x['times'][v]['fwd_bwd_ms']:.3f}" for v in VARIANTS)
            lines.append(f"| {step} | {x['layer']} | {x['union']:.2f} | {cells} |")
    with open(f"{stem}.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main()
