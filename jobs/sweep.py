"""Sweep NSA's selection block size and block count with Ray Tune: throughput against validation loss.

    python jobs/sweep.py                                        # configs/sweep-tiny.yaml: tiny model, 4-trial grid
    python jobs/sweep.py --config my-sweep.yaml --set tune.token_budget=200000
    ray job submit --working-dir . -- python jobs/sweep.py \
        --set tune.storage_path=$PWD/outputs/ray_results --set tracking.tracking_uri=sqlite:///$PWD/outputs/mlflow.db

Each trial trains a TorchTrainer on a fixed token budget; trials are MLflow child runs of the sweep's run, which
gets the summary table (CSV) and the Pareto-front plot (PNG). Rerunning the same command (same tune.name)
resumes an interrupted sweep, even one whose driver was killed mid-trial. Under `ray job submit`, relative paths
resolve inside the job's copy of the working directory (under Ray's session folder): give absolute paths or URIs
(s3://, gs://, an MLflow server) for what should outlive the job. Exit codes: 0 done, 1 a trial failed, 2 bad
config, 130 interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from pipeline.config import load_job_config  # noqa: E402
from pipeline.tracking import ui_command  # noqa: E402
from pipeline.tune import format_summary, run_sweep  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sweep-tiny.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="job YAML with a tune section")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. tune.sel_block=[32,64] (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        job = load_job_config(args.config, args.overrides)  # field checks; the sweep checks the rest before starting
    except (ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"sweep config ({args.config}):\n{job.to_yaml()}", flush=True)
    try:
        result = run_sweep(job)
    except ValueError as e:  # a sweep that cannot work (no valid setting, budget, resources), refused before trials
        print(f"config error: {e}", file=sys.stderr)
        return 2

    print(f"\nsweep {job.tune.name}: {len(result.rows)} trials, {len(result.rejected)} settings refused")
    for r in result.rejected:
        print(f"  refused {r.setting}: {r.reason}")
    print(format_summary(result.rows))
    print("(* = on the Pareto front of throughput against validation loss)")
    print(f"\nTune experiment: {result.experiment_dir}")
    print(f"summary: {result.summary_csv}\nPareto plot: {result.pareto_png}")
    print(f"MLflow parent run: {result.parent_run_id} at {result.tracking_uri}")
    print(f"open the UI: {ui_command(result.tracking_uri)}")
    unfinished = [r["trial_id"] for r in result.rows if r["status"] == "UNFINISHED"]
    if unfinished:
        print(f"the sweep was interrupted before trials {unfinished} finished; rerun the same command to resume it",
              file=sys.stderr)
        return 130
    failed = [r["trial_id"] for r in result.rows if r["status"] == "ERROR"]
    if failed:
        print(f"trials that failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
