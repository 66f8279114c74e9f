"""Probe: how many chosen blocks each program of the decoding attend kernel takes (triton_impl._DECODE_PARTS),
against the nsa-125m graph step's time, at several rows a step (samples drawn together), in one run.

    python bench/probe_decode_parts.py --samples 1,16,64 --parts 0,1,2,4,8,16 --out DIR --commit SHA

Every attend program makes the whole top-n before it attends its own chosen block (kernels/decode.py), so at n = 16
one (batch row, group) makes it 16 times. With one row that costs nothing (the programs run side by side); with many
rows the programs fill the GPU and the repeats are work (v70a: the attend kernel 49 us a layer at 64 rows, 7.5 at
one). PARTS > 1 lets a program attend PARTS blocks after one top-n. Part 0 is the default rule (_attend_parts).

For each row count the prompt runs once per PARTS value, then the same tokens are decoded: each step's logits must
match those of PARTS = 1 (the same partials, merged in the same order) before the graph step (32 replays after both
kinds of step are captured, median of 3 rounds) is timed. Writes DIR/probe-decode-parts-<device>-<date><suffix>.md
and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402

CHECKED_STEPS = 20  # decoding steps whose logits are compared across PARTS values (d = 16: both kinds of step)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,16,64") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be an integer >= 0")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--samples", type=int_list, default=[1, 16, 64])
    ap.add_argument("--parts", type=int_list, default=[0, 1, 2, 4, 8, 16], help="0: the default rule")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    if 0 in args.samples:
        ap.error("--samples: every row count must be >= 1")
    if 1 not in args.parts:
        ap.error("--parts: needs 1, the value the others are checked against")
    return args


def step_times(model, prompt, samples: int) -> tuple[list, float]:
    """(the logits of CHECKED_STEPS steps, the graph step's ms) of `samples` rows after `prompt`."""
    import torch

    from nsa_model.generate import DecodingSteps

    steps = DecodingSteps(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (samples, CHECKED_STEPS), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(2))
    steps.prompt(prompt, samples)
    logits = [steps(tokens[:, i:i + 1]).float() for i in range(CHECKED_STEPS)]  # both kinds captured on the way
    token = tokens[:, -1:]
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(32):
            steps(token)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) * 1e3 / 32)
    return logits, statistics.median(rounds)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from nsa_model import Transformer, get_preset
    from nsa_model.ops import triton_impl

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_decode_parts.py needs a CUDA GPU")
    cfg = get_preset("nsa-125m").replace(max_seq_len=args.prompt_len + CHECKED_STEPS + 3 * 32)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # as bench/decode.py: weights that make the model look past its own token
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model = model.cuda()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    rows = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for samples in args.samples:
            reference = None
            for parts in sorted(args.parts, key=lambda p: p != 1):  # PARTS = 1 first: the others' reference
                triton_impl._DECODE_PARTS = parts or None
                logits, ms = step_times(model, prompt, samples)
                if reference is None:
                    reference = logits
                # as a fraction of each step's logit range: the same partials, but each PARTS value is its own
                # compiled kernel, whose last-bit differences bf16 may round up to a logit's ulp
                diff = max(((a - b).abs().amax(-1) / (b.amax(-1) - b.amin(-1))).max().item()
                           for a, b in zip(logits, reference, strict=True))
                if diff > 2e-2:
                    raise AssertionError(f"samples {samples}, parts {parts}: logits off PARTS = 1's by {diff:.1e} "
                                         "of their range")
                used = triton_impl._attend_parts(samples * cfg.n_kv_heads, cfg.nsa.n_selected)
                rows.append({"samples": samples, "parts": parts, "parts_used": used, "graph_step_ms": ms,
                             "logits_off": diff})
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
            triton_impl._DECODE_PARTS = None
    stem, meta = result_stem(args.out, "probe-decode-parts", args.suffix, args.commit or git_commit())
    meta.update({"prompt_len": args.prompt_len, "rows": rows})
    lines = ["| samples (rows a step) | PARTS | graph step ms | logits off PARTS = 1's |", "|---|---|---|---|"]
    lines += [f"| {r['samples']} | {r['parts_used']}{' (default)' if r['parts'] == 0 else ''} | "
              f"{r['graph_step_ms']:.3f} | {r['logits_off']:.1e} |" for r in rows]
    table = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    result_file(stem, ".json").write_text(json.dumps(meta, indent=2) + "\n")
    result_file(stem, ".md").write_text(
        f"# Decoding attend kernel: chosen blocks a program\n\n{meta['device']}, {meta['date']}, commit "
        f"{meta['commit']}, torch {meta['torch']}, triton {meta['triton']}; nsa-125m after a {args.prompt_len}-token "
        f"prompt, bf16; each row's logits over {CHECKED_STEPS} steps checked against PARTS = 1's.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
