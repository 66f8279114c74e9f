"""A Ray Tune sweep's record, read back from its MLflow store (bench/train_gpu_sweep.sh's, or any sweep's).

    python bench/sweep_report.py --mlruns /path/to/mlruns --sweep sweep-125m-gpu --device "2x NVIDIA H200" \
        --commit abc1234 --tag -v72a

The sweep's parent run (named by tune.name) and its trials' child runs, as jobs/sweep.py leaves them: per trial its
NSA setting, status, the reports' tokens/s (steady: after the sweep's throughput_warmup_steps), MFU, training and
validation losses and peak memory. Each trial is compared with the baseline trial (by default the nsa-125m preset's
own setting, l' = 64, n = 16) of the same sweep: its tokens/s as a ratio, its last validation loss as a difference
(the trials train on the same tokens in the same order, so the difference is the setting's and the seed's).
Writes bench/results/sweep-<date><tag>.{json,md} and copies the sweep's Pareto plot beside them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.provenance import file_suffix  # noqa: E402

SETTING = ("sel_block", "n_selected", "cmp_block", "cmp_stride", "window")
HISTORIES = ("tokens_per_s", "mfu", "train_loss", "val_loss", "peak_mem_mb", "data_wait_s", "step_time_s")


def parse_baseline(text: str) -> dict[str, int]:
    """'sel_block=64,n_selected=16' -> {'sel_block': 64, 'n_selected': 16}; a clear error for anything else."""
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in SETTING or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} in --baseline: want FIELD=INT with FIELD one of {SETTING}")
        out[key] = int(value)
    return out


def read_sweep(mlruns: str, sweep: str) -> tuple[dict, list[dict]]:
    """(the parent run's params, one dict per child run: setting, status, metric histories)."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a GPU host's file store (no sqlalchemy there)
    client = MlflowClient(f"file:{Path(mlruns).resolve()}")
    parents = [r for e in client.search_experiments()
               for r in client.search_runs([e.experiment_id], filter_string=f"attributes.run_name = '{sweep}'")]
    if not parents:
        raise SystemExit(f"{mlruns}: no run named {sweep!r} (the sweep's tune.name)")
    parent = max(parents, key=lambda r: r.info.start_time)
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    trials = []
    for run in children:
        params = run.data.params
        setting = {f: int(params[f"nsa.{f}"]) for f in SETTING if f"nsa.{f}" in params}
        trials.append({"trial_id": run.data.tags.get("trial_id", run.info.run_id), "setting": setting,
                       "status": run.data.tags.get("sweep.status", run.info.status),
                       "history": {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
                                   for k in HISTORIES}})
    if not trials:
        raise SystemExit(f"{mlruns}: the sweep {sweep!r} has no trial runs")
    return parent.data.params, trials


def trial_numbers(trial: dict, warmup_steps: int) -> dict:
    """A trial's steady numbers: over the reports after warmup_steps, as the sweep itself counts tokens/s."""
    h = trial["history"]
    steady = [v for s, v in sorted(h["tokens_per_s"].items()) if s > warmup_steps and math.isfinite(v)]
    mfu = [v for s, v in sorted(h["mfu"].items()) if s > warmup_steps]
    wait = [h["data_wait_s"][s] / h["step_time_s"][s] for s in h["step_time_s"] if s > warmup_steps and s in
            h["data_wait_s"] and h["step_time_s"][s] > 0]

    def last(name: str) -> tuple[int, float] | None:
        return (max(h[name]), h[name][max(h[name])]) if h[name] else None

    return {"tokens_per_s": statistics.median(steady) if steady else math.nan,
            "tokens_per_s_min": min(steady, default=math.nan), "tokens_per_s_max": max(steady, default=math.nan),
            "steady_reports": len(steady), "mfu": statistics.median(mfu) if mfu else math.nan,
            "data_wait_share": statistics.median(wait) if wait else math.nan,
            "val_loss": last("val_loss"), "train_loss": last("train_loss"),
            "peak_mem_mb": max(h["peak_mem_mb"].values(), default=math.nan)}


def compare(trials: list[dict], baseline: dict[str, int], warmup_steps: int) -> list[dict]:
    """Rows sorted by setting, each with its ratio and loss difference to the baseline trial."""
    rows = [{"trial_id": t["trial_id"], "setting": t["setting"], "status": t["status"],
             **trial_numbers(t, warmup_steps)} for t in trials]
    base = [r for r in rows if all(r["setting"].get(k) == v for k, v in baseline.items())]
    if len(base) != 1:
        raise SystemExit(f"baseline {baseline}: {len(base)} trials match it; the sweep has "
                         f"{[r['setting'] for r in rows]}")
    (base,) = base
    for r in rows:
        r["baseline"] = r is base
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        same_step = r["val_loss"] and base["val_loss"] and r["val_loss"][0] == base["val_loss"][0]
        r["val_loss_diff"] = r["val_loss"][1] - base["val_loss"][1] if same_step else math.nan
    return sorted(rows, key=lambda r: tuple(r["setting"].get(f, 0) for f in SETTING))


def markdown(result: dict) -> str:
    lines = [f"# Ray Tune sweep: {result['sweep']}, {result['device']}, {result['date']}", "",
             f"commit {result['commit']}; read back from the sweep's MLflow store by bench/sweep_report.py. "
             f"tokens/s: median of the reports after step {result['warmup_steps']} (min-max beside it); ratio and "
             f"val-loss difference to the baseline trial {result['baseline']} of the same sweep.", "",
             "| l' | n | status | tokens/s (min-max) | / baseline | MFU | data wait | val loss (step) | - baseline | "
             "last train loss | peak MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = r["setting"]
        val = f"{r['val_loss'][1]:.4f} ({r['val_loss'][0]})" if r["val_loss"] else "-"
        diff = "-" if math.isnan(r["val_loss_diff"]) else f"{r['val_loss_diff']:+.4f}"
        train = f"{r['train_loss'][1]:.4f}" if r["train_loss"] else "-"
        speed = ("-" if math.isnan(r["tokens_per_s"]) else
                 f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f})")
        mark = " (baseline)" if r["baseline"] else ""
        lines.append(f"| {s.get('sel_block', '-')} | {s.get('n_selected', '-')} | {r['status']}{mark} | {speed} | "
                     f"{r['tokens_per_s_ratio']:.3f} | {r['mfu']:.3f} | {100 * r['data_wait_share']:.2f}% | {val} | "
                     f"{diff} | {train} | {r['peak_mem_mb']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mlruns", required=True, help="the MLflow file store folder the sweep logged to")
    p.add_argument("--sweep", required=True, help="the sweep's tune.name (its parent run's name)")
    p.add_argument("--device", required=True, help="what the sweep ran on, e.g. '2x NVIDIA H200'")
    p.add_argument("--commit", required=True)
    p.add_argument("--baseline", type=parse_baseline, default=parse_baseline("sel_block=64,n_selected=16"))
    p.add_argument("--pareto", default=None, help="the sweep's pareto.png, copied beside the record")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--tag", type=file_suffix, default="")
    args = p.parse_args(argv)
    params, trials = read_sweep(args.mlruns, args.sweep)
    warmup = int(params.get("tune.throughput_warmup_steps", 0))
    rows = compare(trials, args.baseline, warmup)
    result = {"sweep": args.sweep, "device": args.device, "commit": args.commit, "baseline": args.baseline,
              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "warmup_steps": warmup,
              "token_budget": params.get("tune.token_budget"), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{out}/sweep-{dt.date.today().isoformat()}{args.tag}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    Path(f"{stem}.md").write_text(text)
    if args.pareto:
        Path(f"{stem}-pareto.png").write_bytes(Path(args.pareto).read_bytes())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
