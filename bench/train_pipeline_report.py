"""Issue 9's pipeline numbers, read back from the MLflow store of bench/train_gpu_pipeline.sh.

    python bench/train_pipeline_report.py --mlruns /path/to/mlruns --device "2x NVIDIA H200" --commit abc1234

Runs (by MLflow run name): nsa-2gpu (2 GPUs, stopped after step `--resume-step` and resumed), nsa-1gpu and
dense-1gpu (one GPU each, the same global batch; the data is dealt per worker, so 1 and 2 GPUs read it in
different orders). From the metrics each run's rank 0 logged:
  scaling efficiency = steady tokens/s of nsa-2gpu / (2 x steady tokens/s of nsa-1gpu)   target >= 0.9
  data wait share    = data wait / step time of nsa-2gpu, steady intervals              target <= 2%
  resume             = nsa-2gpu's steps continue after the stop, and its losses follow nsa-1gpu's
  quality            = validation loss of nsa vs dense on the same tokens and steps (PNG)
Steady intervals leave out the first `--skip` reports after every start (start-up, first-step allocation).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import file_suffix  # noqa: E402

RUNS = ("nsa-2gpu", "nsa-1gpu", "dense-1gpu")
SCALING_TARGET, DATA_WAIT_TARGET = 0.9, 0.02


def histories(mlruns: str, experiment: str) -> dict[str, dict[str, dict[int, float]]]:
    """{run name: {metric: {step: value}}} of the experiment's runs named in RUNS (the latest run per name)."""
    from mlflow.tracking import MlflowClient

    # The GPU scripts log to a file store (their hosts lack sqlalchemy), which MLflow 3 refuses to open unless
    # opted in: this reads only the store it is pointed at, so it opts in itself (a call at stop 68 lost its
    # report to a shell without the scripts' export)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file:{Path(mlruns).resolve()}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"{mlruns}: no experiment {experiment!r}")
    out = {}
    for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        name = run.info.run_name
        if name not in RUNS:
            continue
        out[name] = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
                     for key in ("tokens_per_s", "step_time_s", "data_wait_s", "train_loss", "val_loss", "mfu",
                                 "peak_mem_mb")}
        out[name]["status"] = run.info.status
    return out


def steady(h: dict[str, dict[int, float]], starts: list[int], skip: int) -> dict[str, float]:
    """Time-weighted steady numbers over the reports not among the first `skip` after each start step."""
    steps = sorted(h["step_time_s"])
    excluded = set()
    for s in starts:
        excluded |= set([x for x in steps if x > s][:skip])
    kept = [s for s in steps if s not in excluded]
    if not kept:
        raise SystemExit(f"steps {steps} starting at {starts}: leaving out the first {skip} reports after each start "
                         "leaves none to measure; lower --skip or run longer")
    prev = {s: p for p, s in zip([0] + steps, steps)}
    n = {s: s - prev[s] for s in kept}
    seconds = sum(n[s] * h["step_time_s"][s] for s in kept)
    tokens = sum(n[s] * h["step_time_s"][s] * h["tokens_per_s"][s] for s in kept)
    return {"tokens_per_s": tokens / seconds, "data_wait_share": sum(n[s] * h["data_wait_s"][s] for s in kept) / seconds,
            "step_time_s": seconds / sum(n.values()), "steps_measured": sum(n.values()),
            "mfu": max(h["mfu"].values()) if h["mfu"] else None, "peak_mem_mb": max(h["peak_mem_mb"].values())}


def plot(h: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("nsa-1gpu", "-o"), ("dense-1gpu", "-s"), ("nsa-2gpu", "--x")):
        v = h.get(name, {}).get("val_loss") or {}
        if v:
            status = "" if h[name]["status"] == "FINISHED" else f" ({h[name]['status']})"
            ax.plot(sorted(v), [v[s] for s in sorted(v)], style, label=f"{name}{status}", markersize=4)
    ax.set_xlabel("optimizer step (16 x 2048 tokens)")
    ax.set_ylabel("validation loss (nats per byte token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlruns", required=True)
    p.add_argument("--experiment", default="nsa-issue9")
    p.add_argument("--device", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--resume-step", type=int, default=120)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--tag", type=file_suffix, default="")
    args = p.parse_args(argv)
    h = histories(args.mlruns, args.experiment)
    usable = {n for n in RUNS if n in h and h[n]["step_time_s"] and h[n]["status"] == "FINISHED"}
    starts = {"nsa-2gpu": [0, args.resume_step], "nsa-1gpu": [0], "dense-1gpu": [0]}
    runs = {n: steady(h[n], starts[n], args.skip) for n in RUNS if n in usable}
    result = {"device": args.device, "commit": args.commit,
              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "run_status": {n: h[n]["status"] if n in h else "MISSING" for n in RUNS}, "runs": runs,
              "val_loss": {n: h[n]["val_loss"] for n in h}, "train_loss": {n: h[n]["train_loss"] for n in h}}
    if {"nsa-2gpu", "nsa-1gpu"} <= usable:
        two, one = runs["nsa-2gpu"], runs["nsa-1gpu"]
        result["scaling_efficiency"] = two["tokens_per_s"] / (2 * one["tokens_per_s"])
        result["data_wait_share_2gpu"] = two["data_wait_share"]
        two_steps = sorted(h["nsa-2gpu"]["train_loss"])
        common = sorted(set(two_steps) & set(h["nsa-1gpu"]["train_loss"]))
        result["resume"] = {"stop_step": args.resume_step, "reported_steps": two_steps,
                            "continued": args.resume_step in two_steps and two_steps[-1] > args.resume_step,
                            "max_train_loss_gap_vs_1gpu": max(abs(h["nsa-2gpu"]["train_loss"][s] -
                                                                  h["nsa-1gpu"]["train_loss"][s]) for s in common)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"train-pipeline-{dt.date.today().isoformat()}{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    if "dense-1gpu" in h:  # the quality comparison; a scaling-only store (train_gpu_scaling.sh) has no dense run
        plot(h, out / f"{stem}-val-loss.png", f"nsa-125m vs dense: same tokens and steps\n{args.device}")
    lines = [f"# Pipeline on GPUs: {args.device}, {result['date']}", "", f"commit {args.commit}; MLflow file store read "
             f"back by bench/train_pipeline_report.py; steady intervals skip the first {args.skip} reports after each start.",
             "", "| run | status | tokens/s | step s | data wait | max MFU | peak MiB | last val loss (step) |",
             "|---|---|---|---|---|---|---|---|"]
    for name in RUNS:
        status = result["run_status"][name]
        val = h.get(name, {}).get("val_loss") or {}
        last = f"{val[max(val)]:.4f} ({max(val)})" if val else "-"
        r = runs.get(name)
        if r is None:
            lines.append(f"| {name} | {status} | - | - | - | - | - | {last} |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        lines.append(f"| {name} | {status} | {r['tokens_per_s']:.0f} | {r['step_time_s']:.3f} | "
                     f"{100 * r['data_wait_share']:.2f}% | {mfu} | {r['peak_mem_mb']:.0f} | {last} |")
    lines.append("")
    if "scaling_efficiency" in result:
        eff, wait, res = result["scaling_efficiency"], result["data_wait_share_2gpu"], result["resume"]
        lines += [f"- scaling efficiency (2-GPU tokens/s over twice 1-GPU): **{eff:.3f}** (target >= {SCALING_TARGET}: "
                  f"{'met' if eff >= SCALING_TARGET else 'NOT met'})",
                  f"- data wait share of step time, 2 GPUs: **{100 * wait:.2f}%** (target <= 2%: "
                  f"{'met' if wait <= DATA_WAIT_TARGET else 'NOT met'})",
                  f"- checkpoint and resume: stopped after step {args.resume_step}, rerun reported up to step "
                  f"{res['reported_steps'][-1]}: {'works' if res['continued'] else 'FAILED'}; largest train-loss gap "
                  f"to the 1-GPU run at the same steps: {res['max_train_loss_gap_vs_1gpu']:.4f} (the 1-GPU run "
                  f"reads the same corpus in another order: a bound on the noise, not an identity)"]
    else:
        lines.append("- scaling efficiency, 2-GPU data wait, resume: not measured (nsa-2gpu or nsa-1gpu did not finish)")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
