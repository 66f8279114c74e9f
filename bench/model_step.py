"""One training step of the model alone (no Ray, no data pipeline), NSA against dense, and where its time goes.

    python bench/model_step.py --preset nsa-125m --seq-lens 2048,8192,32768 [--eager] [--no-profile] [--memory] \
        [--compile-mode reduce-overhead] [--launch slc_auto_tiled_fwd_blocks=8 ...]

For each T and attention kind (the preset and its `-dense` twin): the decoder with bf16 autocast over fp32
parameters, fused AdamW, `torch.compile` of the whole model unless --eager, the same tokens per optimizer step
(gradient accumulation over micro-batches of --micro-tokens). Steady-state step time (CUDA events, median of
--measure steps after --warmup), tokens/s, peak memory; then, unless --no-profile, one profiled step: wall time,
GPU busy time (kernel time summed), the largest kernels, and kernel time by category (NSA core kernels, the
rest of the model's compiled kernels, matmuls, elementwise glue), so that a gap between NSA and dense can be put
on the attention kernels, on the glue around them, or on the host; and the step's timeline: how long the GPU runs
no kernel at all, how much kernel time runs beside other kernels (NSA's second stream), and between which kernels
the idle gaps fall.

This isolates the model from the pipeline; bench/train_throughput.py measures the same through the project's own
training loop (issue 9's numbers). Writes bench/results/model-step-<device>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.launch import launch_overrides  # noqa: E402,F401  (also this module's --launch parser)
from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402
from nsa_model import Transformer, get_preset  # noqa: E402
from nsa_model.model import compile_model as compile_nsa_model  # noqa: E402
from pipeline.train.loop import FlatGradients, cudagraph_skips  # noqa: E402

# Kernel names of the NSA core (nsa_model/kernels), for the breakdown.
NSA_KERNELS = ("range_attn", "selected_", "select_blocks", "gated_sum", "row_dot")


def category(name: str) -> str:
    if any(name.startswith(k) for k in NSA_KERNELS):
        return "nsa core (triton)"
    lowered = name.lower()
    if "gemm" in lowered or "sm90_xmma" in lowered or "cutlass" in lowered or "nvjet" in lowered:
        return "matmul (cuBLAS)"
    if "flash" in lowered or "fmha" in lowered or "cudnn" in lowered:
        return "dense attention (SDPA)"
    if name.startswith("triton_"):
        return "compiled glue (inductor)"
    if "sort" in lowered or "scan" in lowered or "search" in lowered:
        return "sort/scan (torch)"
    return "other (torch eager)"


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes whose compiled graphs replay as CUDA graphs


def build(preset: str, attention: str, seq_len: int, compile_model: bool, compile_mode: str = "default",
          model_overrides: dict | None = None):
    cfg = get_preset(preset if attention == "nsa" else f"{preset}-dense").replace(max_seq_len=seq_len,
                                                                                  **(model_overrides or {}))
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, fused=True)
    fwd = compile_nsa_model(model, mode=compile_mode) if compile_model else model  # as the training loop
    return cfg, model, fwd, opt


def make_step(fwd, opt, batches, cudagraphs: bool = False):
    # as the training loop does: under CUDA graphs the gradients live outside the graphs, zeroed in place
    grads = FlatGradients(opt) if cudagraphs else None

    def step():
        for x, y in batches:
            if cudagraphs:  # each micro-batch replays the graphs: the previous one's outputs are dead by now
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = fwd(x, y)
            if grads is not None:
                grads.backward(loss / len(batches))
            else:
                (loss / len(batches)).backward()
            loss = loss.detach().clone()  # a graph output would be overwritten by the next replay
        opt.step()
        if grads is not None:
            grads.zero_()
        else:
            opt.zero_grad(set_to_none=True)
        return loss
    return step


GPU_ACTIVITY = ("kernel", "gpu_memset", "gpu_memcpy")  # what the GPU runs, by the profiler's trace categories


def trace_activity(trace: dict) -> list[tuple[str, float, float, str]]:
    """(name, start us, duration us, stream) of every kernel, memset and copy in a chrome trace's events."""
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("tid", "")))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY]


def timeline(activity: list[tuple[str, float, float, str]], top: int = 12) -> dict:
    """When the GPU works and when it waits, from (name, start us, duration us, stream) intervals.

    busy: time with at least one kernel, memset or copy running (the union over streams); idle: the span less
    busy; concurrent: the time that ran beside other work (the summed time less busy). The idle gaps are added up by the pair
    of kernels around them (the last to end before the gap, the first to start after it), largest first: where
    a step waits on a dependency rather than on work."""
    if not activity:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "concurrent_ms": 0.0, "streams": 0, "gaps": []}
    spans = sorted((start, start + dur, name) for name, start, dur, _ in activity)
    busy, gaps = 0.0, {}
    seg_start, seg_end, last_name = spans[0][0], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > seg_end:  # a gap: nothing runs between seg_end and start
            busy += seg_end - seg_start
            key = (last_name[:60], name[:60])
            total, count = gaps.get(key, (0.0, 0))
            gaps[key] = (total + start - seg_end, count + 1)
            seg_start, seg_end, last_name = start, end, name
        elif end >= seg_end:
            seg_end, last_name = end, name
    busy += seg_end - seg_start
    span = seg_end - spans[0][0]
    summed = sum(dur for _, _, dur, _ in activity)
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "concurrent_ms": (summed - busy) / 1e3, "streams": len({s for *_, s in activity}),
            "gaps": [{"before": a, "after": b, "ms": t / 1e3, "count": n} for (a, b), (t, n) in ranked]}


def profile_step(step) -> dict:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        gpu_timeline = timeline(trace_activity(json.loads(Path(f"{tmp}/trace.json").read_text())))
    kernels, counts, categories, cpu_ops = {}, {}, {}, {}
    for e in prof.key_averages():
        gpu_us = getattr(e, "self_device_time_total", None)
        if gpu_us is None:
            gpu_us = getattr(e, "self_cuda_time_total", 0)
        if gpu_us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key[:80]] = kernels.get(e.key[:80], 0.0) + gpu_us / 1e3
            counts[e.key[:80]] = counts.get(e.key[:80], 0) + e.count
            cat = category(e.key)
            categories[cat] = categories.get(cat, 0.0) + gpu_us / 1e3
        elif e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
            cpu_ops[e.key[:80]] = cpu_ops.get(e.key[:80], 0.0) + e.self_cpu_time_total / 1e3
    top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15])
    top_cpu = dict(sorted(cpu_ops.items(), key=lambda kv: -kv[1])[:10])
    return {"wall_ms": wall_ms, "gpu_busy_ms": sum(kernels.values()), "kernel_count": len(kernels),
            "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])), "top_kernels_ms": top,
            "top_cpu_self_ms": top_cpu, "timeline": gpu_timeline,
            "kernels": {k: {"ms": v, "calls": counts[k]} for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}}


def kernel_difference(nsa: dict, dense: dict, top: int = 25) -> list[tuple[str, float, float, int, int]]:
    """The kernels outside the NSA core whose time differs most between the NSA and the dense step (name, NSA ms,
    dense ms, NSA calls, dense calls): where NSA's extra glue and projections go."""
    names = {k for k in (*nsa, *dense) if category(k) != "nsa core (triton)"}
    rows = [(k, nsa.get(k, {}).get("ms", 0.0), dense.get(k, {}).get("ms", 0.0), nsa.get(k, {}).get("calls", 0),
             dense.get(k, {}).get("calls", 0)) for k in names]
    return sorted(rows, key=lambda r: -abs(r[1] - r[2]))[:top]


REPO_DIRS = ("/nsa_model/", "/pipeline/", "/bench/")


def _site(frames: list[dict]) -> str:
    """Where an allocation comes from: the innermost frame in the project's code, else the innermost frame."""
    for f in frames:
        if any(d in f["filename"] for d in REPO_DIRS):
            return f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    if frames:
        f = frames[0]
        return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return "(no python frame)"


def memory_breakdown(step, top: int = 12) -> dict:
    """One step with the CUDA caching allocator's history on: the tensors alive at the step's peak, by the source
    line that allocated them (innermost project frame). Saved activations show up under the forward code that
    made them, transient buffers under the kernel launcher that needed them."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc", stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snap["device_traces"] for e in trace]
    return peak_sites(events, top)


def peak_sites(events: list[dict], top: int = 12) -> dict:
    """From an allocator trace (alloc / free_completed events with addr, size, frames): the peak of the traced
    allocations and what is alive at that moment, summed by allocating site. Frees of blocks allocated before
    the trace started are ignored (they were never counted)."""
    events = [e for e in events if e["action"] in ("alloc", "free_completed")]
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(events):  # first pass: when the peak happens
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        else:
            total -= live.pop(e["addr"], 0)
        if total > peak:
            peak, peak_at = total, i
    alive = {}
    for e in events[:peak_at + 1]:  # second pass: what is alive at that moment
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        else:
            alive.pop(e["addr"], None)
    sites: dict[str, list] = {}
    for e in alive.values():
        entry = sites.setdefault(_site(e.get("frames", [])), [0, 0])
        entry[0] += e["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {"traced_peak_mib": peak / 2**20, "events": len(events),
            "sites": [{"site": k, "mib": v[0] / 2**20, "tensors": v[1]} for k, v in ranked[:top]],
            "rest_mib": sum(v[0] for _, v in ranked[top:]) / 2**20}


def measure(preset, attention, seq_len, tokens_per_step, micro_tokens, warmup, measure_steps, compile_model,
            profile, memory=False, compile_mode="default", model_overrides=None) -> dict:
    skips_before = cudagraph_skips()
    cfg, model, fwd, opt = build(preset, attention, seq_len, compile_model, compile_mode, model_overrides)
    micro_b = max(1, micro_tokens // seq_len)
    accum = tokens_per_step // (micro_b * seq_len)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for _ in range(accum):
        tok = torch.randint(0, cfg.vocab_size, (micro_b, seq_len + 1), device="cuda", generator=gen)
        batches.append((tok[:, :-1], tok[:, 1:]))
    cudagraphs = compile_model and compile_mode in CUDA_GRAPH_MODES
    step = make_step(fwd, opt, batches, cudagraphs=cudagraphs)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(measure_steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    step_s = statistics.median(times)
    row = {"attention": attention, "seq_len": seq_len, "micro_batch": micro_b, "accum": accum,
           "tokens_per_step": micro_b * seq_len * accum, "step_s": step_s, "step_s_all": times,
           "tokens_per_s": micro_b * seq_len * accum / step_s, "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
           # under CUDA graphs the activations live in the graphs' pools, which only the reserved figure shows
           "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
           "warmup_s": warmup_s, "loss": float(loss), "params": model.num_params(),
           "flops_per_token": model.flops_per_token(seq_len)}
    if cudagraphs:  # graphs inductor runs with plain launches instead
        row["cudagraph_skips"] = cudagraph_skips() - skips_before
    row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / 989e12
    if profile:
        row["profile"] = profile_step(step)
    if memory:
        row["memory"] = memory_breakdown(step)
    del model, fwd, opt, batches
    torch.cuda.empty_cache()
    return row


PROFILE_COLUMNS = ("nsa core (triton)", "matmul (cuBLAS)", "compiled glue (inductor)")


def _profile_cells(profile: dict | None) -> str:
    """The step table's profile columns: wall / GPU busy ms, then the core, matmul, glue and the other categories'
    ms; "-" in each where the row ran without a profile (--no-profile), not zeros that read as measured."""
    if not profile:
        return " | ".join(["- / -"] + ["-"] * (len(PROFILE_COLUMNS) + 1))
    c = profile.get("categories_ms", {})
    other = sum(v for k, v in c.items() if k not in PROFILE_COLUMNS)
    return " | ".join([f"{profile.get('wall_ms', 0):.1f} / {profile.get('gpu_busy_ms', 0):.1f}"]
                      + [f"{c.get(k, 0):.1f}" for k in PROFILE_COLUMNS] + [f"{other:.1f}"])


def markdown(meta, rows) -> str:
    compiled = "eager" if meta["eager"] else f"torch.compile (mode {meta.get('compile_mode', 'default')})"
    lines = [f"# Model step, NSA vs dense: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, preset {meta['preset']}, {meta['tokens_per_step']} "
             f"tokens per step (micro-batches of {meta['micro_tokens']}), {compiled}"
             f", bf16 autocast, fused AdamW, median of {meta['measure']} steps after {meta['warmup']}; "
             f"MFU of 989 TFLOP/s."
             + (f" Triton core launch config changed: {meta['launch_overrides']}." if meta.get("launch_overrides")
                else "")
             + (f" Model config changed: {meta['model_overrides']}." if meta.get("model_overrides") else ""), "",
             "| attention | T | tokens/s | step ms | MFU | peak MiB allocated / reserved | profiled step: wall ms / GPU busy ms | "
             "NSA core kernels ms | matmul ms | compiled glue ms | other ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['seq_len']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['mfu']:.3f} | {r['peak_mib']:,.0f} / {r.get('peak_reserved_mib', 0):,.0f} | "
                     + _profile_cells(r.get("profile")) + " |")
    by_t = {}
    for r in rows:
        by_t.setdefault(r["seq_len"], {})[r["attention"]] = r
    skipped = [f"{r['attention']} T={r['seq_len']}: {r['cudagraph_skips']}" for r in rows if "cudagraph_skips" in r]
    if skipped:
        lines += ["", "Compiled graphs run without CUDA graphs (inductor's cudagraph_skips): " + ", ".join(skipped)
                  + "."]
    lines += ["", "| T | NSA / dense tokens/s | NSA / dense peak memory |", "|---|---|---|"]
    for t, pair in by_t.items():
        if "nsa" in pair and "dense" in pair:
            lines.append(f"| {t} | {pair['nsa']['tokens_per_s'] / pair['dense']['tokens_per_s']:.3f} | "
                         f"{pair['nsa']['peak_mib'] / pair['dense']['peak_mib']:.3f} |")
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            lines += ["", f"## {r['attention']} T={r['seq_len']}: kernels of one profiled step (GPU ms)", ""]
            lines += ["- by category: " + ", ".join(f"{k} {v:.1f}" for k, v in p["categories_ms"].items())]
            lines += ["- largest: " + ", ".join(f"{k} {v:.2f}" for k, v in p["top_kernels_ms"].items())]
            lines += ["- host (self CPU ms): " + ", ".join(f"{k} {v:.1f}" for k, v in p["top_cpu_self_ms"].items())]
            tl = p.get("timeline")
            if tl:
                lines += [f"- timeline: span {tl['span_ms']:.1f} ms, GPU busy (any stream) {tl['busy_ms']:.1f}, idle "
                          f"{tl['idle_ms']:.1f}, kernel time beside other kernels {tl['concurrent_ms']:.1f}, "
                          f"{tl['streams']} streams",
                          "- largest idle gaps, by the kernels around them (ms, count): "
                          + "; ".join(f"`{g['before']}` -> `{g['after']}` {g['ms']:.2f} ({g['count']})"
                                      for g in tl["gaps"])]
    for t, pair in by_t.items():
        if "kernels" in pair.get("nsa", {}).get("profile", {}) and "kernels" in pair.get("dense", {}).get("profile", {}):
            diff = kernel_difference(pair["nsa"]["profile"]["kernels"], pair["dense"]["profile"]["kernels"])
            lines += ["", f"## T={t}: kernels outside the NSA core, NSA step against dense step (GPU ms)", "",
                      "| kernel | category | NSA ms (calls) | dense ms (calls) | NSA - dense |", "|---|---|---|---|---|"]
            lines += [f"| `{k}` | {category(k)} | {a:.2f} ({ca}) | {b:.2f} ({cb}) | {a - b:+.2f} |"
                      for k, a, b, ca, cb in diff]
    for r in rows:
        if "memory" in r:
            m = r["memory"]
            lines += ["", f"## {r['attention']} T={r['seq_len']}: tensors alive at the step's peak "
                      f"({m['traced_peak_mib']:,.0f} MiB traced), by allocating line", "",
                      "| site | MiB | tensors |", "|---|---|---|"]
            lines += [f"| `{x['site']}` | {x['mib']:,.0f} | {x['tensors']} |" for x in m["sites"]]
            lines.append(f"| (all other sites) | {m['rest_mib']:,.0f} | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="nsa-125m")
    ap.add_argument("--seq-lens", default="2048,8192,32768")
    ap.add_argument("--attention", default="nsa,dense")
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--micro-tokens", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--measure", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                    help="torch.compile mode; reduce-overhead and max-autotune replay each compiled graph as a CUDA "
                         "graph, max-autotune also times Triton GEMMs against cuBLAS and tunes the glue's tiles")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--memory", action="store_true", help="also one step with the allocator's history: what is "
                    "alive at the peak, by allocating source line")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=VALUE",
                    help="a LaunchConfig change for the Triton core (repeatable), e.g. slc_kernel=by_block")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=VALUE",
                    help="a ModelConfig change for both models (repeatable), e.g. fused_qkv=False")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/model_step.py needs a CUDA GPU")
    seq_lens = [int(t) for t in args.seq_lens.split(",")]
    for t in seq_lens:
        if args.tokens_per_step % t or args.micro_tokens % t and t < args.micro_tokens:
            raise SystemExit(f"--tokens-per-step {args.tokens_per_step} and --micro-tokens {args.micro_tokens} "
                             f"must be multiples of T={t}")
    overrides = launch_overrides(args.launch)
    if overrides:  # the Triton backend imports only here, on the GPU host (CI imports this module without it)
        import dataclasses

        from nsa_model.ops import triton_impl
        triton_impl.set_launch_config(dataclasses.replace(triton_impl.launch_config(), **overrides))
    stem, meta = result_stem(args.out, "model-step", args.suffix, args.commit or git_commit())
    meta.update(preset=args.preset, tokens_per_step=args.tokens_per_step, micro_tokens=args.micro_tokens,
                eager=args.eager, warmup=args.warmup, measure=args.measure, compile_mode=args.compile_mode,
                launch_overrides=overrides, model_overrides=launch_overrides(args.model))
    stem.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for t in seq_lens:
        for attention in args.attention.split(","):
            try:
                row = measure(args.preset, attention, t, args.tokens_per_step, args.micro_tokens, args.warmup,
                              args.measure, not args.eager, not args.no_profile, args.memory, args.compile_mode,
                              meta["model_overrides"])
            except Exception as e:  # recorded, the other rows still run
                import traceback
                traceback.print_exc()
                row = {"attention": attention, "seq_len": t, "error": repr(e)[:400], "tokens_per_s": 0.0,
                       "step_s": 0.0, "mfu": 0.0, "peak_mib": 0.0}
                torch.cuda.empty_cache()
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            rows.append(row)
            result_file(stem, ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            result_file(stem, ".md").write_text(markdown(meta, [r for r in rows if "error" not in r]))
    print(markdown(meta, [r for r in rows if "error" not in r]))


if __name__ == "__main__":
    main()
