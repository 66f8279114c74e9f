"""Training throughput of NSA against dense attention, through the project's own training loop (issue 9).

For each attention kind (the preset and its `-dense` twin) and each sequence length T, the job of --config is
trained for warmup + measured steps with the same tokens per optimizer step, by build_trainer (Ray Train,
train_loop_per_worker), all on one Ray cluster in this process. The loop reports its own interval metrics
(tokens/s, MFU, step time, data wait, peak memory) every `warmup` steps; a Ray Train callback writes each report
to a JSONL file, and the first interval (start-up, torch.compile) is left out of the steady state.

    # GPU (one worker, bf16, compiled), issue 9's lengths:
    python bench/train_throughput.py --config configs/bench-train-gpu.yaml --seq-lens 2048,8192,32768
    # T=32768 with NSA's attention module recomputing its projections in the backward (less memory):
    python bench/train_throughput.py --config configs/bench-train-gpu.yaml --seq-lens 32768 \
        --nsa-set train.attention_recompute=true
    # CPU smoke of the same path on the tiny preset:
    python bench/train_throughput.py --config configs/bench-train-cpu.yaml --seq-lens 64,128 \
        --tokens-per-step 1024 --micro-tokens 512 --warmup 2 --measure 4

Writes bench/results/train-<device>-<date it started>.{json,md}: per run tokens/s, MFU, peak memory, data-wait share;
per T the ratio NSA / dense against issue 9's targets.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory

from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402

# Issue 9: NSA tokens/s over dense tokens/s, same run, per T; and NSA peak memory at 32768 <= dense.
SPEED_TARGETS = {2048: 0.7, 8192: 1.0, 32768: 1.6}
MEMORY_TARGET_T = 32768


# --- the runs ------------------------------------------------------------------------------------------------------

def run_overrides(*, preset: str, attention: str, seq_len: int, tokens_per_step: int, micro_tokens: int,
                  warmup: int, measure: int, storage: str) -> list[str]:
    """Config overrides of one benchmark run: equal tokens per step, reports every `warmup` steps."""
    if tokens_per_step % seq_len or micro_tokens % seq_len:
        raise ValueError(f"--tokens-per-step {tokens_per_step} and --micro-tokens {micro_tokens} must be "
                         f"multiples of T={seq_len}")
    if measure % warmup:
        raise ValueError(f"--measure {measure} must be a multiple of --warmup {warmup} (reports every warmup steps)")
    global_batch = tokens_per_step // seq_len
    micro_batch = min(micro_tokens // seq_len, global_batch)
    model_preset = preset if attention == "nsa" else f"{preset}-dense"
    return [f"model.preset={model_preset}", f"model.max_seq_len={seq_len}", f"data.seq_len={seq_len}",
            f"train.global_batch={global_batch}", f"train.micro_batch={micro_batch}",
            f"train.max_steps={warmup + measure}", f"train.log_every={warmup}", "train.warmup_steps=1",
            "train.val_every=0", "train.val_batches=1", "train.checkpoint_every=0", "train.keep_checkpoints=1",
            "train.max_failures=0", f"train.run_name=bench-{attention}-T{seq_len}", f"train.storage_path={storage}",
            "tracking.enabled=false"]


class ReportRecorder:
    """Ray Train callback (runs in the controller process): appends rank 0's reported metrics to a JSONL file."""

    def __new__(cls, path: str):
        from ray.train import UserCallback

        class _Recorder(UserCallback):
            def __init__(self, out: str):
                self.out = out

            def after_report(self, run_context, metrics, checkpoint):
                with open(self.out, "a") as f:
                    f.write(json.dumps(metrics[0]) + "\n")

        return _Recorder(path)


def train_once(job, reports_path: Path) -> list[dict[str, Any]]:
    """Train `job` through build_trainer on the running Ray cluster; return its reports in order."""
    from ray.train import FailureConfig, RunConfig

    from pipeline.train.trainer import build_trainer

    reports_path.unlink(missing_ok=True)
    run_config = RunConfig(name=job.train.run_name, storage_path=job.train.storage_path,
                           failure_config=FailureConfig(max_failures=0),
                           callbacks=[ReportRecorder(str(reports_path))])
    build_trainer(job, run_config=run_config).fit()
    return [json.loads(line) for line in reports_path.read_text().splitlines()]


# --- turning reports into numbers (pure; tested on CPU) -------------------------------------------------------------

def steady_state(reports: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Steady-state numbers of one run from its interval reports (each covering `warmup` steps).

    The first interval (steps 1..warmup: start-up, compilation) is excluded. tokens/s is total tokens over total
    time of the remaining intervals (not a mean of rates); MFU scales with it; peak memory is the largest seen.
    """
    steady = [r for r in reports if r["step"] > warmup]
    if not steady:
        raise ValueError(f"no report after the warm-up (step > {warmup}); reports at steps "
                         f"{[r['step'] for r in reports]}")
    steps = [r["step"] - prev["step"] for prev, r in zip(reports, reports[1:]) if r["step"] > warmup]
    seconds = sum(n * r["step_time_s"] for n, r in zip(steps, steady))
    tokens = sum(n * (r["tokens_seen"] / r["step"]) for n, r in zip(steps, steady))
    tokens_per_s = tokens / seconds
    out = {"steps_measured": sum(steps), "tokens_per_s": tokens_per_s, "step_time_s": seconds / sum(steps),
           "data_wait_share": sum(n * r["data_wait_s"] for n, r in zip(steps, steady)) / seconds,
           "peak_mem_mb": max(r["peak_mem_mb"] for r in reports),
           "peak_reserved_mb": max(r.get("peak_reserved_mb", float("nan")) for r in reports),
           "train_loss_last": steady[-1]["train_loss"], "skipped_steps": steady[-1]["skipped_steps"]}
    last = steady[-1]
    if "cudagraph_skips" in last:  # under CUDA graphs: compiled graphs inductor runs with plain launches instead
        out["cudagraph_skips"] = int(last["cudagraph_skips"])
    if "mfu" in last:  # MFU is proportional to tokens/s: rescale the last interval's to the steady rate
        out["mfu"] = last["mfu"] * tokens_per_s / last["tokens_per_s"]
    return out


def compare(runs: dict[tuple[str, int], dict[str, Any]], memory_key: str = "peak_mem_mb") -> list[dict[str, Any]]:
    """Per T: NSA / dense tokens/s and peak memory, against issue 9's targets where it names one. memory_key:
    peak_mem_mb (allocated), or peak_reserved_mb under CUDA graphs, whose pools the allocated peak does not see."""
    rows = []
    for T in sorted({T for _, T in runs}):
        nsa, dense = runs.get(("nsa", T)), runs.get(("dense", T))
        row: dict[str, Any] = {"seq_len": T, "speed_target": SPEED_TARGETS.get(T)}
        if nsa is None or dense is None or "error" in nsa or "error" in dense:
            row["status"] = "incomplete (a run failed or is missing)"
            rows.append(row)
            continue
        row["speed_ratio"] = nsa["tokens_per_s"] / dense["tokens_per_s"]
        row["memory_ratio"] = nsa[memory_key] / dense[memory_key]
        verdicts = []
        if row["speed_target"] is not None:
            verdicts.append("speed met" if row["speed_ratio"] >= row["speed_target"] else "speed NOT met")
        if T == MEMORY_TARGET_T:
            row["memory_target"] = 1.0
            verdicts.append("memory met" if row["memory_ratio"] <= 1.0 else "memory NOT met")
        row["status"] = ", ".join(verdicts) or "no target at this T"
        rows.append(row)
    return rows


def markdown(meta: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    def num(x, fmt):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    lines = [f"# Training throughput, NSA vs dense: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']} (nsa_model {meta.get('nsa_model', '?').split()[0]}), torch {meta['torch']}, "
             f"preset {meta['preset']}, {meta['tokens_per_step']} "
             f"tokens per optimizer step (micro-batches of {meta['micro_tokens']} tokens), {meta['warmup']} warm-up "
             f"steps excluded, {meta['measure']} measured; config {meta['config']}; {meta['compile_note']}"
             + "".join(f"; {kind} only: {', '.join(meta[f'{kind}_overrides'])}" for kind in ("nsa", "dense")
                       if meta.get(f"{kind}_overrides")), "",
             "| attention | T | tokens/s | MFU | step s | data wait | peak MiB allocated / reserved | last loss |",
             "|---|---|---|---|---|---|---|---|"]
    for (attn, T), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "nsa")):
        if "error" in r:
            lines.append(f"| {attn} | {T} | failed: {r['error'][:120]} | | | | | |")
            continue
        lines.append(f"| {attn} | {T} | {r['tokens_per_s']:.0f} | {num(r.get('mfu'), '.3f')} | {r['step_time_s']:.3f} | "
                     f"{100 * r['data_wait_share']:.2f}% | {r['peak_mem_mb']:.0f} / "
                     f"{num(r.get('peak_reserved_mb'), '.0f')} | {r['train_loss_last']:.3f} |")
    skipped = [f"{attn} T={T}: {r['cudagraph_skips']}" for (attn, T), r in sorted(runs.items())
               if "cudagraph_skips" in r]
    if skipped:
        lines += ["", "Compiled graphs run without CUDA graphs (inductor's cudagraph_skips, per worker process): "
                  + ", ".join(skipped) + "."]
    lines += ["", f"| T | NSA/dense tokens/s | target | NSA/dense peak memory ({meta.get('memory_measure', 'allocated')}) "
              "| target | status |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['seq_len']} | {num(row.get('speed_ratio'), '.3f')} | {num(row.get('speed_target'), '>')} | "
                     f"{num(row.get('memory_ratio'), '.3f')} | {'<= 1' if row.get('memory_target') else '-'} | "
                     f"{row['status']} |")
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------------------------------

def write_results(args, base, runs: dict[tuple[str, int], dict[str, Any]], stem, meta: dict[str, Any]) -> str:
    """Write stem.json and stem.md (result_stem's, taken once when the benchmark starts: a call that runs past
    midnight UTC rewrites one pair of files, not a partial pair under each date); returns the markdown."""
    from pipeline.train.loop import uses_cuda_graphs

    cuda_graphs = uses_cuda_graphs(base.train)
    preset = (base.raw.get("model") or {}).get("preset", "tiny")
    meta = dict(meta)
    compile_note = (f"torch.compile (mode {base.train.compile_mode}) of the whole model, one graph: the Triton NSA "
                    "core as the custom op nsa::core in NSA's, SDPA in dense's" if base.train.compile
                    else "eager (no torch.compile)")
    meta.update(preset=preset, config=args.config, overrides=args.set, nsa_overrides=args.nsa_set,
                dense_overrides=args.dense_set, tokens_per_step=args.tokens_per_step, micro_tokens=args.micro_tokens,
                warmup=args.warmup, measure=args.measure, compile_note=compile_note,
                memory_measure="reserved" if cuda_graphs else "allocated")
    rows = compare(runs, "peak_reserved_mb" if cuda_graphs else "peak_mem_mb")
    stem.parent.mkdir(parents=True, exist_ok=True)
    result_file(stem, ".json").write_text(json.dumps(
        {"meta": meta, "runs": [{"attention": k, "seq_len": T, **r} for (k, T), r in runs.items()],
         "comparison": rows}, indent=1))
    table = markdown(meta, runs, rows)
    result_file(stem, ".md").write_text(table)
    return table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="base job YAML (model preset, device, precision, compile, data)")
    p.add_argument("--seq-lens", default="2048,8192,32768", help="comma-separated T values")
    p.add_argument("--attention", default="nsa,dense", help="comma-separated: nsa, dense")
    p.add_argument("--tokens-per-step", type=int, default=65536)
    p.add_argument("--micro-tokens", type=int, default=32768, help="tokens per forward (grad accumulation beyond)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out (start-up, compile); also the report cadence")
    p.add_argument("--measure", type=int, default=6, help="measured steps (a multiple of --warmup)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more config overrides")
    p.add_argument("--nsa-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides of the NSA runs only (printed in the results' header)")
    p.add_argument("--dense-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="overrides of the dense runs only (printed in the results' header)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse of this checkout)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results folder")
    p.add_argument("--tag", type=file_suffix, default="", help="suffix of the results file names")
    return p.parse_args(argv)


def job_overrides(args: argparse.Namespace, preset: str, kind: str, seq_len: int, storage: str) -> list[str]:
    """All overrides of one run: --set, then --nsa-set or --dense-set for its kind, then the run's own."""
    own = args.nsa_set if kind == "nsa" else args.dense_set
    return args.set + own + run_overrides(preset=preset, attention=kind, seq_len=seq_len,
                                          tokens_per_step=args.tokens_per_step, micro_tokens=args.micro_tokens,
                                          warmup=args.warmup, measure=args.measure, storage=storage)


def main(argv=None) -> int:
    args = parse_args(argv)
    import ray

    from pipeline.config import load_job_config

    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    kinds = [x.strip() for x in args.attention.split(",")]
    bad = sorted(set(kinds) - {"nsa", "dense"})
    if bad:
        raise SystemExit(f"--attention: unknown {bad}; use nsa, dense")
    base = load_job_config(args.config, args.set)
    preset = (base.raw.get("model") or {}).get("preset", "tiny")
    storage = tempfile.mkdtemp(prefix="bench-train-")
    jobs = {}  # every config is built (and its fields checked) before anything runs
    for T in seq_lens:
        for kind in kinds:
            jobs[(kind, T)] = load_job_config(args.config, job_overrides(args, preset, kind, T, storage))
    stem, meta = result_stem(args.out, "train", args.tag, args.commit or git_commit())
    ray.init(address="local", include_dashboard=False)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for (kind, T), job in jobs.items():
        print(f"\n=== {kind} T={T}: global batch {job.train.global_batch} x {T}, micro-batch {job.train.micro_batch}, "
              f"grad accum {job.train.grad_accum}", flush=True)
        t0 = time.time()
        try:
            reports = train_once(job, Path(storage) / f"reports-{kind}-{T}.jsonl")
            runs[(kind, T)] = {**steady_state(reports, args.warmup), "reports": reports}
        except Exception as e:  # one failed run (e.g. out of memory) is recorded and the others still run
            runs[(kind, T)] = {"error": f"{type(e).__name__}: {e}".replace("\n", " ")}
        runs[(kind, T)]["wall_s"] = time.time() - t0
        print(f"=== {kind} T={T}: {json.dumps({k: v for k, v in runs[(kind, T)].items() if k != 'reports'})}",
              flush=True)
        write_results(args, base, runs, stem, meta)  # after every run: a call cut short still leaves what it measured
    ray.shutdown()
    print("\n" + write_results(args, base, runs, stem, meta))
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
