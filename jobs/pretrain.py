"""Pretrain an NSA language model with Ray Train.

    python jobs/pretrain.py                                   # configs/tiny.yaml: tiny NSA model, embedded corpus
    python jobs/pretrain.py --config configs/nsa-125m.yaml --set train.storage_path=s3://bucket/runs
    ray job submit --working-dir . -- python jobs/pretrain.py --set train.max_steps=50

Joins the Ray cluster that `ray job submit` or RAY_ADDRESS names, else starts a local one. Rerunning with the
same train.run_name (and storage path) resumes from the run's latest checkpoint into the same MLflow run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory

from pipeline.config import DEFAULT_CONFIG, load_job_config  # noqa: E402
from pipeline.tracking import ui_command  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML job config (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config field, e.g. --set train.max_steps=10 (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = load_job_config(args.config, args.set)
    except (ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"# resolved config ({args.config}{' + ' + ' '.join(args.set) if args.set else ''})")
    print(job.to_yaml(), flush=True)

    from pipeline.ray_cluster import init_ray
    from pipeline.train.trainer import run_pretraining

    print(init_ray(), flush=True)  # RAY_ADDRESS's cluster (ray job submit), else a new local one

    def announce(resolved, run_id, uri) -> None:
        print(f"run directory: {resolved.run_dir}")
        if run_id is not None:
            print(f"MLflow run {run_id} (experiment {resolved.tracking.experiment!r}) at {uri}", flush=True)
        print(f"training {resolved.train.max_steps} steps of {resolved.train.global_batch} x "
              f"{resolved.data.seq_len} tokens on {resolved.train.num_workers} workers", flush=True)

    start = time.time()
    try:
        result = run_pretraining(job, on_start=announce)
    except ValueError as e:  # preflight: a config that cannot work, refused before any worker started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    m = result.metrics
    print(f"\ndone in {time.time() - start:.0f} s: step {m.get('step')}, train loss {m.get('train_loss', float('nan')):.4f}"
          + (f", val loss {m['val_loss']:.4f}" if "val_loss" in m else ""))
    print(f"run directory:     {result.run_dir}")
    print(f"latest checkpoint: {result.checkpoint_path}")
    if result.mlflow_run_id is not None:
        print(f"MLflow run:        {result.mlflow_run_id} at {result.tracking_uri}")
        print(f"open the UI with:  {ui_command(result.tracking_uri)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
