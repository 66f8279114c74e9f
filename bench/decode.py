"""Decoding speed: new tokens a second with the layers' caches (Transformer.forward_cached) against running the
whole context for every token (the path before the cache), same model, prompt and device, in one run.

    python bench/decode.py                                   # CPU: tiny (NSA and dense), 1024-token prompt
    python bench/decode.py --preset nsa-125m --device cuda --prompt-len 8192 --new-tokens 64 --out DIR --commit SHA

Checked before it is timed: the logits of a prompt and of --check-steps cached steps after it against one forward
pass over the same tokens, as a fraction of each position's logit range. On CPU the check runs a float64 copy of
the model (every position within 1e-9: in float32 a near-tie between two blocks' importance can fall either way
when the full pass's shapes differ, and so can the full pass's own logits at T and T + 8). On a GPU it runs under
bf16 autocast, where the Triton core runs the prompt and the decoding steps run in PyTorch: the median step
within 1e-2, the steps past 3e-2 (near-ties) counted in the results. Then each path generates --new-tokens greedy
tokens after the prompt (the first one comes from the prompt's pass; on a GPU the cached path's later steps replay
one CUDA graph of the step, as generate() does), timed end to end, --repeats times; the median counts. The model's
max_seq_len leaves room for every step after the prompt, so no step crops the context. NSA's decoding step reads Tc
+ n*l' + w keys a head where the full pass reads every position, so the ratio grows with the prompt. --profile (GPU)
adds the step's own times (eager, and replayed from its graph) and an eager step's kernels by GPU time.
--samples N times N continuations drawn together (generate_samples: the prompt once, each step of all N rows)
against N calls of generate() with the cache, one at a time, instead of against the whole context.
Writes DIR/decode-<device>-<date><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402

PRESETS = {"tiny": ("tiny", "tiny-dense"), "nsa-125m": ("nsa-125m", "nsa-125m-dense")}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="the NSA preset and its dense twin")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--prompt-len", type=positive, default=1024)
    ap.add_argument("--new-tokens", type=positive, default=64)
    ap.add_argument("--samples", type=positive, default=1,
                    help="continuations of the prompt drawn together (generate_samples); > 1: timed against "
                         "drawing them one at a time with the cache, instead of against the whole context")
    ap.add_argument("--check-steps", type=positive, default=8)
    ap.add_argument("--repeats", type=positive, default=2)
    ap.add_argument("--decode-kernel", choices=("torch", "triton"), default=None,
                    help="a CUDA decoding step's NSA: PyTorch ops or kernels/decode.py (default: the launch config's)")
    ap.add_argument("--profile", action="store_true",
                    help="also time the cached step alone and list the kernels of one eager step (GPU)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        ap.error(f"--device: expected cpu or cuda, got {args.device!r}")
    return args


def build_model(preset: str, max_seq_len: int, device: str):
    import torch

    from nsa_model import Transformer, get_preset

    cfg = get_preset(preset).replace(max_seq_len=max_seq_len)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # as initialized a model barely looks past its own token; these weights make it look
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.to(device)


def autocast(device: str):
    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def relative_error(got, want, rows: int = 4096):
    """[T] float64: max |got - want| over each row [T, vocab] as a fraction of want's range in that row, in float64
    a few thousand rows at a time (a 128k prompt's logits are 53 GB in float64)."""
    import torch

    errors = []
    for start in range(0, want.shape[0], rows):
        g, w = got[start:start + rows].double(), want[start:start + rows].double()
        errors.append((g - w).abs().amax(dim=-1) / (w.amax(dim=-1) - w.amin(dim=-1)))
    return torch.cat(errors)


def check(model, prompt, steps: int, device: str) -> dict:
    """|cached - full| logit error per position, as a fraction of that position's logit range, at the prompt and at
    `steps` decoding steps after it (see the module's docstring); raises where it is past the tolerance."""
    import copy

    import torch

    if device == "cpu":
        model = copy.deepcopy(model).double()
    tokens = torch.cat([prompt, torch.randint(0, model.cfg.vocab_size, (1, steps), device=device)], dim=1)
    with torch.no_grad(), autocast(device):
        full, _ = model(tokens)
        cache = model.new_cache()
        parts = [model.forward_cached(tokens[:, :prompt.shape[1]], cache)]
        parts += [model.forward_cached(tokens[:, t:t + 1], cache) for t in range(prompt.shape[1], tokens.shape[1])]
    prompt_error = relative_error(parts[0][0], full[0, :prompt.shape[1]])
    stepped = relative_error(torch.cat(parts[1:], dim=1)[0], full[0, prompt.shape[1]:])
    error = torch.cat([prompt_error, stepped])
    result = {"prompt_max": prompt_error.max().item(), "steps_max": stepped.max().item(),
              "steps_median": stepped.median().item(), "steps_past_3e-2": int((stepped > 3e-2).sum()),
              "steps": steps}
    bad = error.max().item() > 1e-9 if device == "cpu" else result["steps_median"] > 1e-2
    if bad:
        raise AssertionError(f"{model.cfg.attention}: cached logits off the full pass's: {result}")
    return result


def time_generate(model, prompt: list[int], new_tokens: int, samples: int, way: str, device: str):
    """(seconds, the first sample's tokens) of `samples` greedy continuations, end to end: `way` "cached" draws
    them together (generate_samples with the cache), "one_at_a_time" one generate() call each (with the cache, as
    jobs/sample.py did before v70), "full" together over the whole context a token."""
    import torch

    from nsa_model.generate import generate, generate_samples

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with autocast(device):
        if way == "one_at_a_time":
            out = [generate(model, prompt, new_tokens, temperature=0) for _ in range(samples)]
        else:
            out = generate_samples(model, prompt, new_tokens, samples, temperature=0, use_cache=way == "cached")
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out[0]


def profile_step(model, prompt, samples: int) -> dict:
    """Milliseconds of the prompt's pass, of one eager decoding step and of one replay of a captured step (32 in
    a row, one sync, after each kind of step has been captured), each step of `samples` rows, and the kernels of
    an eager step by GPU time."""
    import torch

    from nsa_model.generate import DecodingSteps

    def timed(fn, repeat=1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / repeat

    token = prompt[:, -1:].repeat(samples, 1)
    with torch.no_grad(), autocast("cuda"):
        steps = DecodingSteps(model)
        prefill_ms = timed(lambda: steps.prompt(prompt, samples))
        while any(model.step_compresses(p) not in steps.graphs  # every kind the timed steps meet, captured
                  for p in range(steps.cache.length, steps.cache.length + 32)):
            steps(token)
        eager = DecodingSteps(model)  # its prompt and cache only: stepped eagerly, through forward_cached
        eager.prompt(prompt, samples)
        eager = eager.cache
        eager_ms = timed(lambda: model.forward_cached(token, eager))
        first = steps.cache.length
        replay_ms = timed(lambda: steps(token), repeat=32)
        profiled_compresses = model.step_compresses(eager.length)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.forward_cached(token, eager)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    return {"prefill_ms": prefill_ms, "eager_step_ms": eager_ms, "graph_step_ms": replay_ms, "kernels": table,
            # of the 32 timed steps, those that ended a compressed token (a graph of their own, with phi)
            "graph_steps_compressing": sum(model.step_compresses(p) for p in range(first, first + 32)),
            "profiled_step_compresses": profiled_compresses}


def measure(preset: str, args) -> dict:
    import torch

    # room for the timed tokens, the check's steps and the profile's steps after the prompt: up to d (16) until
    # each kind of step has its graph, then 32 timed
    room = max(args.new_tokens, args.check_steps, 64 if args.profile else 0)
    model = build_model(preset, args.prompt_len + room, args.device)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(1))
    checked = check(model, prompt, args.check_steps, args.device)
    ids = prompt[0].tolist()
    baseline = "full" if args.samples == 1 else "one_at_a_time"
    # warm-up at the prompt's length, every kernel compiled before timing: the timed runs start at the same
    # position, and within d + 1 steps they meet every kind of step (one that ends a compressed token among them;
    # v70a timed that kind's compile at 16 samples: 0.87 s, then 0.21)
    warm_up = min(args.new_tokens, model.cfg.nsa.cmp_stride + 2)
    for way in ("cached", baseline):
        time_generate(model, ids, warm_up, args.samples, way, args.device)
    row = {"preset": preset, "attention": model.cfg.attention, "check": checked, "baseline": baseline}
    tokens = args.new_tokens * args.samples
    for way in ("cached", baseline):
        runs = [time_generate(model, ids, args.new_tokens, args.samples, way, args.device)
                for _ in range(args.repeats)]
        seconds = statistics.median(r[0] for r in runs)
        row[way] = {"seconds": seconds, "seconds_all": [r[0] for r in runs], "tokens_per_s": tokens / seconds}
        row[f"{way}_tokens"] = runs[0][1]
    row["speedup"] = row[baseline]["seconds"] / row["cached"]["seconds"]
    if args.profile and args.device == "cuda":
        row["profile"] = profile_step(model, prompt, args.samples)
    row["same_tokens"] = row.pop("cached_tokens") == row.pop(f"{baseline}_tokens")
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.decode_kernel is not None and args.device == "cuda":
        import dataclasses

        from nsa_model.ops import triton_impl

        triton_impl.set_launch_config(dataclasses.replace(triton_impl.launch_config(),
                                                          decode_kernel=args.decode_kernel))
    rows = [measure(preset, args) for preset in PRESETS[args.preset]]
    stem, meta = result_stem(args.out, "decode", args.suffix, args.commit or git_commit())
    meta.update({"decode_kernel": args.decode_kernel or "default", "prompt_len": args.prompt_len,
                 "new_tokens": args.new_tokens, "samples": args.samples, "repeats": args.repeats,
                 "threads": torch.get_num_threads(), "rows": rows})
    if args.samples == 1:
        heads = "| model | cached tokens/s | full-context tokens/s | cached / full |"
    else:
        heads = (f"| model | {args.samples} samples together, tokens/s | one sample at a time (cached), tokens/s | "
                 "together / one at a time |")
    lines = [heads + " same greedy tokens | check: prompt max; steps max / median, past 3e-2 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        c = r["check"]
        lines.append(f"| {r['preset']} | {r['cached']['tokens_per_s']:.1f} | {r[r['baseline']]['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'no'} | {c['prompt_max']:.1e}; "
                     f"{c['steps_max']:.1e} / {c['steps_median']:.1e}, {c['steps_past_3e-2']} of {c['steps']} |")
    table = "\n".join(lines)
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            kind = "one that ends a compressed token" if p["profiled_step_compresses"] else "one that ends none"
            table += (f"\n\n{r['preset']}: prompt pass {p['prefill_ms']:.1f} ms, eager step "
                      f"{p['eager_step_ms']:.2f} ms, graph step {p['graph_step_ms']:.2f} ms ({args.samples} "
                      f"row{'s' if args.samples > 1 else ''} a step; 32 in a row, "
                      f"{p['graph_steps_compressing']} of them ending a compressed token); an eager step's kernels "
                      f"({kind}):\n\n```\n{p['kernels']}\n```")
    os.makedirs(args.out, exist_ok=True)
    result_file(stem, ".json").write_text(json.dumps(meta, indent=2) + "\n")
    per_sample = f" in each of {args.samples} samples" if args.samples > 1 else ""
    result_file(stem, ".md").write_text(
        f"# Decoding: cached steps against the whole context a token\n\n{meta['device']}, {meta['date']}, commit "
        f"{meta['commit']}, torch {meta['torch']}; prompt {args.prompt_len} tokens, {args.new_tokens} greedy new "
        f"tokens{per_sample}, median of {args.repeats} (each timed end to end, prompt included); {meta['threads']} "
        f"CPU threads.\n\n{table}\n")
    print(table)
    print(f"wrote {result_file(stem, '.md')}")


if __name__ == "__main__":
    main()
