"""A Ray Tune sweep's record, read back from its MLflow store (bench/train_gpu_sweep.sh's, or any sweep's).

    python bench/sweep_report.py --mlruns /path/to/mlruns --sweep sweep-125m-gpu --device "2x NVIDIA H200" \
        --commit abc1234 --tag=-h200x2-v72a

The sweep's parent run (named by tune.name) and its trials' child runs, as jobs/sweep.py leaves them: per trial its
NSA setting, init seed (train.seed), status, the reports' tokens/s (steady: after the sweep's
throughput_warmup_steps), MFU, training and validation losses, peak memory, its startup (seconds from its trainer's
launch to the end of its second step, by phase) and its wall time (its MLflow run's). Trials are grouped by setting (one
per init seed), and each setting is compared with the baseline setting (by default the nsa-125m preset's own,
l' = 64, n = 16) of the same sweep: its mean tokens/s as a ratio, its mean last validation loss as a difference. The
trials read the same tokens in the same order, so a setting's range over seeds is the noise its difference is read
against.
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
# pipeline/train/loop.py's Startup, reported once a run (again by a resumed one; the first is the trial's start)
STARTUP = ("launch", "model", "compile_cache", "kernels", "data", "first_step", "second_step", "total")
# and what it compiled (Startup's CompileCounts; stores from before stop 78 have none)
COMPILES = ("nsa_kernels_compiled", "nsa_compile_s", "nsa_kernels_cached", "fxgraph_cache_hits", "fxgraph_cache_misses",
            "compile_cache_loaded", "compile_cache_saved", "compile_cache_triton_loaded", "compile_cache_triton_saved")


def parse_baseline(text: str) -> dict[str, int]:
    """'sel_block=64,n_selected=16' -> {'sel_block': 64, 'n_selected': 16}; a clear error for anything else."""
    out = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in SETTING or not value.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} in --baseline: want FIELD=INT with FIELD one of {SETTING}")
        out[key] = int(value)
    return out


def _param(run, name: str) -> str:
    """A run's parameter, or a clear error: every run jobs/sweep.py leaves has it."""
    if name not in run.data.params:
        raise SystemExit(f"MLflow run {run.info.run_id} ({run.info.run_name}) has no parameter {name!r}: not a run "
                         f"of a jobs/sweep.py sweep")
    return run.data.params[name]


def read_sweep(mlruns: str, sweep: str):
    """(the sweep's parent run, one dict per child run: setting, init seed, status, metric histories)."""
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
                       "init_seed": int(_param(run, "train.seed")),
                       "status": run.data.tags.get("sweep.status", run.info.status),
                       "wall_s": (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else math.nan,
                       "history": {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
                                   for k in (*HISTORIES, *(f"startup_{p}_s" for p in STARTUP),
                                             *(f"startup_{c}" for c in COMPILES))}})
    if not trials:
        raise SystemExit(f"{mlruns}: the sweep {sweep!r} has no trial runs")
    return parent, trials


def trial_numbers(trial: dict, warmup_steps: int) -> dict:
    """A trial's steady numbers: over the reports after warmup_steps, as the sweep itself counts tokens/s."""
    h = trial["history"]
    steady = [v for s, v in sorted(h["tokens_per_s"].items()) if s > warmup_steps and math.isfinite(v)]
    mfu = [v for s, v in sorted(h["mfu"].items()) if s > warmup_steps]
    wait = [h["data_wait_s"][s] / h["step_time_s"][s] for s in h["step_time_s"] if s > warmup_steps and s in
            h["data_wait_s"] and h["step_time_s"][s] > 0]

    def last(name: str) -> tuple[int, float] | None:
        return (max(h[name]), h[name][max(h[name])]) if h[name] else None

    def first(name: str) -> float:
        return h[name][min(h[name])] if h.get(name) else math.nan

    return {"tokens_per_s": statistics.median(steady) if steady else math.nan,
            "tokens_per_s_min": min(steady, default=math.nan), "tokens_per_s_max": max(steady, default=math.nan),
            "steady_reports": len(steady), "mfu": statistics.median(mfu) if mfu else math.nan,
            "data_wait_share": statistics.median(wait) if wait else math.nan,
            "val_loss": last("val_loss"), "train_loss": last("train_loss"),
            "peak_mem_mb": max(h["peak_mem_mb"].values(), default=math.nan),
            "startup": {p: first(f"startup_{p}_s") for p in STARTUP},
            "compiles": {c: first(f"startup_{c}") for c in COMPILES}, "wall_s": trial.get("wall_s", math.nan)}


def trial_rows(trials: list[dict], warmup_steps: int) -> list[dict]:
    """One row per trial, sorted by setting and init seed."""
    rows = [{"trial_id": t["trial_id"], "setting": t["setting"], "init_seed": t["init_seed"], "status": t["status"],
             **trial_numbers(t, warmup_steps)} for t in trials]
    return sorted(rows, key=lambda r: (tuple(r["setting"].get(f, 0) for f in SETTING), r["init_seed"]))


def setting_rows(rows: list[dict], baseline: dict[str, int]) -> list[dict]:
    """One row per setting over its trials (one per init seed): mean tokens/s and its ratio to the baseline setting's,
    the validation losses (mean, range, and the mean's difference to the baseline's when all ended at one step)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(sorted(r["setting"].items())), []).append(r)
    out = []
    for key, trials in groups.items():
        vals = [t["val_loss"] for t in trials if t["val_loss"]]
        steps = {v[0] for v in vals}
        losses = [v[1] for v in vals]
        out.append({"setting": dict(key), "trials": len(trials), "init_seeds": [t["init_seed"] for t in trials],
                    "statuses": sorted({t["status"] for t in trials}),
                    "tokens_per_s": statistics.fmean(t["tokens_per_s"] for t in trials),
                    "tokens_per_s_min": min(t["tokens_per_s_min"] for t in trials),
                    "tokens_per_s_max": max(t["tokens_per_s_max"] for t in trials),
                    "mfu": statistics.fmean(t["mfu"] for t in trials),
                    "data_wait_share": statistics.fmean(t["data_wait_share"] for t in trials),
                    "val_step": steps.pop() if len(steps) == 1 and len(vals) == len(trials) else None,
                    "val_losses": losses, "val_loss": statistics.fmean(losses) if losses else math.nan,
                    "val_loss_range": max(losses) - min(losses) if len(losses) > 1 else math.nan,
                    "peak_mem_mb": max(t["peak_mem_mb"] for t in trials),
                    "startup_s": statistics.fmean(t["startup"]["total"] for t in trials),
                    "wall_s": statistics.fmean(t["wall_s"] for t in trials)})
    base = [s for s in out if all(s["setting"].get(k) == v for k, v in baseline.items())]
    if len(base) != 1:
        raise SystemExit(f"baseline {baseline}: {len(base)} settings match it; the sweep has "
                         f"{[s['setting'] for s in out]}")
    (base,) = base
    for s in out:
        s["baseline"] = s is base
        s["tokens_per_s_ratio"] = s["tokens_per_s"] / base["tokens_per_s"]
        comparable = s["val_step"] is not None and s["val_step"] == base["val_step"]
        s["val_loss_diff"] = s["val_loss"] - base["val_loss"] if comparable else math.nan
    return sorted(out, key=lambda s: tuple(s["setting"].get(f, 0) for f in SETTING))


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def markdown(result: dict) -> str:
    lines = [f"# Ray Tune sweep: {result['sweep']}, {result['device']}, {result['date']}", "",
             f"commit {result['commit']}; read back from the sweep's MLflow store by bench/sweep_report.py. A trial's "
             f"tokens/s is the median of its reports after step {result['warmup_steps']}; a setting's is the mean over "
             f"its trials (one per init seed), with the range of every steady report beside it. Ratio and val-loss "
             f"difference are to the baseline setting {result['baseline']} of the same sweep.", "",
             "| l' | n | trials | tokens/s (reports' range) | / baseline | MFU | data wait | val loss: mean (step) | "
             "per seed | range | mean - baseline | peak MiB | startup s | trial s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["settings"]:
        st = s["setting"]
        mark = " (baseline)" if s["baseline"] else ""
        lines.append(
            f"| {st.get('sel_block', '-')} | {st.get('n_selected', '-')} | {s['trials']} {'/'.join(s['statuses'])}"
            f"{mark} | {_num(s['tokens_per_s'], ',.0f')} ({_num(s['tokens_per_s_min'], ',.0f')}-"
            f"{_num(s['tokens_per_s_max'], ',.0f')}) | {_num(s['tokens_per_s_ratio'], '.3f')} | "
            f"{_num(s['mfu'], '.3f')} | "
            f"{_num(100 * s['data_wait_share'], '.2f')}% | {_num(s['val_loss'], '.4f')} ({s['val_step']}) | "
            f"{', '.join(f'{v:.4f}' for v in s['val_losses'])} | {_num(s['val_loss_range'], '.4f')} | "
            f"{_num(s['val_loss_diff'], '+.4f')} | {_num(s['peak_mem_mb'], ',.0f')} | {_num(s['startup_s'], '.1f')} | "
            f"{_num(s['wall_s'], '.1f')} |")
    if any(s["trials"] > 1 for s in result["settings"]):
        lines += ["", "| trial | l' | n | init seed | status | tokens/s | val loss (step) | last train loss |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["trials"]:
            val = f"{r['val_loss'][1]:.4f} ({r['val_loss'][0]})" if r["val_loss"] else "-"
            train = f"{r['train_loss'][1]:.4f}" if r["train_loss"] else "-"
            lines.append(f"| {r['trial_id']} | {r['setting'].get('sel_block', '-')} | "
                         f"{r['setting'].get('n_selected', '-')} | {r['init_seed']} | {r['status']} | "
                         f"{_num(r['tokens_per_s'], ',.0f')} | {val} | {train} |")
    lines += ["", "Where each trial's time went before its steps reached their pace (seconds; pipeline/train/loop.py's "
              "Startup: launch = Ray Train's controller and workers, model = model and optimizer, compile_cache = "
              "torch.compile's artifacts and Triton's cache entries loaded from the shared compile cache "
              "(train.compile_cache), kernels = the NSA kernels compiled before the first step "
              "(train.precompile_kernels; \"-\" where not), data = what is left of reading the held-out batches and "
              "the first training batch, which start beside the phases before it, then the first two steps with "
              "compilation and CUDA graphs), what it compiled "
              "(the NSA kernels its worker compiled and those it read from Triton's cache; inductor's FX graph cache; "
              "the artifacts it loaded from the shared compile cache and saved to it, + Triton's cache entries where "
              "counted) and its whole wall time (its "
              "MLflow run's, final checkpoint and teardown included):",
              "", "| startup of trial | l' | n | init seed | " + " | ".join(STARTUP)
              + " | NSA kernels compiled (s) | NSA kernels cached | FX graph cache hits / misses | shared compile "
              "cache loaded / saved | trial wall |",
              "|---|---|---|---|" + "---|" * (len(STARTUP) + 5)]
    for r in result["trials"]:
        st = r["setting"]
        lines.append(f"| {r['trial_id']} | {st.get('sel_block', '-')} | {st.get('n_selected', '-')} | {r['init_seed']} | "
                     + " | ".join(_num(r["startup"][p], ".1f") for p in STARTUP)
                     + f" | {_compiles(r['compiles'])} | {_num(r['wall_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def _compiles(c: dict) -> str:
    """A trial's four compile cells, "-" where its store has no counts (runs from before they were logged)."""
    shared = (f"{c['compile_cache_loaded']:.0f} / {c['compile_cache_saved']:.0f}"
              if math.isfinite(c.get("compile_cache_loaded", math.nan)) else "-")
    if math.isfinite(c.get("compile_cache_triton_loaded", math.nan)):  # stores from stop 81 on
        shared = (f"{c['compile_cache_loaded']:.0f} + {c['compile_cache_triton_loaded']:.0f} / "
                  f"{c['compile_cache_saved']:.0f} + {c['compile_cache_triton_saved']:.0f}")
    if not math.isfinite(c.get("nsa_kernels_compiled", math.nan)):
        return " | ".join(["-"] * 3 + [shared])
    return (f"{c['nsa_kernels_compiled']:.0f} ({c['nsa_compile_s']:.1f}) | {c['nsa_kernels_cached']:.0f} | "
            f"{c['fxgraph_cache_hits']:.0f} / {c['fxgraph_cache_misses']:.0f} | {shared}")


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
    parent, trials = read_sweep(args.mlruns, args.sweep)
    warmup = int(_param(parent, "tune.throughput_warmup_steps"))
    rows = trial_rows(trials, warmup)
    started = dt.datetime.fromtimestamp(parent.info.start_time / 1000, dt.timezone.utc)  # when it was measured
    result = {"sweep": args.sweep, "device": args.device, "commit": args.commit, "baseline": args.baseline,
              "date": started.strftime("%Y-%m-%d %H:%M UTC"), "warmup_steps": warmup,
              "token_budget": int(_param(parent, "tune.token_budget")), "settings": setting_rows(rows, args.baseline),
              "trials": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{out}/sweep-{started.date().isoformat()}{args.tag}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    Path(f"{stem}.md").write_text(text)
    if args.pareto:
        Path(f"{stem}-pareto.png").write_bytes(Path(args.pareto).read_bytes())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
