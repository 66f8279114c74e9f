"""build_trainer: a JobConfig -> a Ray Train TorchTrainer (preflight, data, MLflow run, scaling, failures).

    trainer = build_trainer(job)              # Tune passes run_config=RunConfig(name=<trial id>, ...)
    result = trainer.fit()
    # or: run_pretraining(job) -> PretrainingResult, what jobs/pretrain.py calls.

Rerunning the same train.run_name with the same storage_path resumes from its latest checkpoint (Ray Train keeps
its checkpoint list in the run folder) and logs into the same MLflow run (its id is persisted there too).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from pipeline import tracking
from pipeline.config import JobConfig, preflight, resolve_paths
from pipeline.train.loop import train_loop_per_worker

log = logging.getLogger(__name__)


def default_run_config(job: JobConfig) -> RunConfig:
    t = job.train
    return RunConfig(name=t.run_name, storage_path=t.storage_path,
                     checkpoint_config=CheckpointConfig(num_to_keep=t.keep_checkpoints),
                     failure_config=FailureConfig(max_failures=t.max_failures))


def scaling_config(job: JobConfig) -> ScalingConfig:
    t = job.train
    resources: dict[str, float] = {"CPU": t.cpus_per_worker}
    if t.use_gpu:
        resources["GPU"] = 1
    return ScalingConfig(num_workers=t.num_workers, use_gpu=t.use_gpu, resources_per_worker=resources)


def _cluster_gpus() -> int | None:
    """GPUs of a cluster that cannot grow, for preflight; None where the count says nothing.

    Only a local cluster this process started itself is fixed in size. A cluster the job joined (ray job
    submit, RAY_ADDRESS) may autoscale from zero GPU nodes, as cluster/*.yaml and KubeRay do: there the
    trainer's worker group waits for the nodes the autoscaler launches, so counting GPUs now would refuse
    every such job.
    """
    if not ray.is_initialized():
        return None
    node = ray._private.worker._global_node  # the Node this driver started, or connected to
    if node is None or not node.head:
        return None
    return int(ray.cluster_resources().get("GPU", 0))


def _open_mlflow_run(job: JobConfig, run_dir: str, run_name: str, tokenizer) -> tuple[str | None, str]:
    uri = tracking.resolve_tracking_uri(job.tracking, job.output_dir)
    if not job.tracking.enabled:
        return None, uri
    with tempfile.TemporaryDirectory(prefix="nsa-run-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(job.to_yaml())
        artifacts = {"config": str(config_file)}
        from pipeline.data.tokenizer import copy_tokenizer

        tok_file = copy_tokenizer(tokenizer, Path(tmp) / "tokenizer")
        if tok_file is not None:
            artifacts["tokenizer"] = str(tok_file)
        params = tracking.flatten(job.to_dict())
        params.update({"tokenizer.name": tokenizer.name, "tokenizer.sha256": tokenizer.sha256,
                       "tokenizer.vocab_size": tokenizer.vocab_size})
        run_id = tracking.open_run(job.tracking, tracking_uri=uri,
                                   artifact_location=tracking.default_artifact_location(uri, job.output_dir),
                                   run_dir=run_dir, default_run_name=run_name, params=params, artifacts=artifacts)
    return run_id, uri


def build_trainer(job: JobConfig, *, run_config: RunConfig | None = None) -> TorchTrainer:
    """The TorchTrainer of this job; the whole config is checked before anything is started."""
    from pipeline.data.dataset import block_datasets
    from pipeline.data.loader import rank_dataset_name, train_data_config
    from pipeline.data.shards import input_shares
    from pipeline.data.tokenizer import load_tokenizer

    job = resolve_paths(job)
    tokenizer = load_tokenizer(job.data)
    preflight(job, tokenizer_vocab_size=tokenizer.vocab_size, gpus_available=_cluster_gpus())
    # The input dealt to the workers (each reads only its own share); refused when a worker would get nothing.
    shares = input_shares(job.data, job.train.num_workers)
    check_data_shares(job, shares)
    if run_config is None:
        run_config = default_run_config(job)
    else:  # the caller (Tune) names and places the run; keep its folder and the job's in agreement
        job = job.replace(train=dataclasses.replace(job.train, run_name=run_config.name,
                                                    storage_path=str(run_config.storage_path or job.train.storage_path)))
        if run_config.checkpoint_config is None or run_config.checkpoint_config.num_to_keep is None:
            run_config = dataclasses.replace(run_config,
                                             checkpoint_config=CheckpointConfig(num_to_keep=job.train.keep_checkpoints))
    run_dir = job.run_dir
    run_id, uri = _open_mlflow_run(job, run_dir, job.train.run_name, tokenizer)
    from pipeline.data.stats import StatsRecorder

    data_stats = {split: StatsRecorder() for split in ("train", "val")}  # documents/tokens/drops, logged at the end
    datasets = {}
    for split in ("train", "val"):  # one dataset per rank and split, each reading only that rank's share
        for rank, ds in enumerate(block_datasets(job.data, split, world_size=job.train.num_workers,
                                                 stats=data_stats[split], shares=shares[split])):
            datasets[rank_dataset_name(split, rank)] = ds
    loop_config = {"job": job, "run_dir": run_dir, "mlflow_run_id": run_id, "tracking_uri": uri,
                   "launched_at": time.time()}  # the workers' startup_launch_s counts from here
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config, scaling_config=scaling_config(job),
        torch_config=TorchConfig(backend="nccl" if job.train.use_gpu else "gloo"),
        datasets=datasets,
        # No splitting: worker r iterates only train_<r> and val_<r>, so only its own share is read (and, when
        # streaming, tokenized); the resume position is one number per run (see pipeline/data/loader.py).
        dataset_config=train_data_config(),
        run_config=run_config)
    trainer.nsa_job = job  # what run_pretraining reports back
    trainer.nsa_mlflow = (run_id, uri)
    trainer.nsa_data_stats = data_stats
    return trainer


def check_data_shares(job: JobConfig, shares) -> None:
    """What can be known of the workers' data shares before the run: prepared data counts its blocks.

    Every worker's share of the held-out split must hold train.val_batches micro-batches (else ValueError);
    a train share shorter than the run needs wraps into its next epoch, said once here (streaming: each
    worker says it when it happens, the block counts being unknown until then)."""
    t = job.train
    if shares["train"].kind != "prepared":
        return
    val_need = t.val_batches * t.micro_batch
    val_sizes = shares["val"].sizes()
    if min(val_sizes) < val_need:
        rank = val_sizes.index(min(val_sizes))
        raise ValueError(f"data.packed_dir: worker {rank}'s share of the val split holds {min(val_sizes)} blocks "
                         f"(shares: {val_sizes}); validation needs train.val_batches * train.micro_batch = {val_need} "
                         f"per worker. Prepare more held-out data (data.val_fraction) or smaller row groups "
                         f"(data.row_group_blocks), or lower train.val_batches")
    train_need = t.max_steps * t.global_batch // t.num_workers
    train_sizes = shares["train"].sizes()
    if min(train_sizes) < train_need:
        msg = (f"data: the run needs {train_need} train blocks per worker, the workers' shares hold {train_sizes}: a "
               f"worker whose share runs out continues with its next epoch (the same blocks again, in the same order)")
        log.warning(msg)
        print(msg, flush=True)


def log_data_stats(trainer: TorchTrainer) -> dict[str, Any]:
    """The data stage's counts (documents read, dropped and altered by reason, tokens, blocks) of this run,
    logged to its MLflow run as data_stats.json. Returns them."""
    stats = {}
    for split, recorder in trainer.nsa_data_stats.items():
        snapshot = recorder.snapshot()
        if snapshot is not None:
            stats[split] = snapshot.to_json()
    run_id, uri = trainer.nsa_mlflow
    if run_id is not None and stats:
        from mlflow.tracking import MlflowClient

        MlflowClient(uri).log_dict(run_id, stats, "data_stats.json")
    return stats


@dataclass
class PretrainingResult:
    job: JobConfig
    metrics: dict[str, Any]
    checkpoint_path: str | None
    run_dir: str
    mlflow_run_id: str | None
    tracking_uri: str


def run_pretraining(job: JobConfig, *, on_start=None) -> PretrainingResult:
    """Train to train.max_steps (resuming when the run exists); mark the MLflow run failed if training fails.

    on_start(job, mlflow_run_id, tracking_uri) is called once everything is checked and before training starts.
    """
    trainer = build_trainer(job)
    run_id, uri = trainer.nsa_mlflow
    if on_start is not None:
        on_start(trainer.nsa_job, run_id, uri)
    try:
        result = trainer.fit()
    except BaseException:
        if run_id is not None:
            tracking.close_run(uri, run_id, "FAILED")
        raise
    log_data_stats(trainer)
    if run_id is not None:
        tracking.close_run(uri, run_id, "FINISHED")
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    return PretrainingResult(job=trainer.nsa_job, metrics=dict(result.metrics or {}), checkpoint_path=checkpoint,
                             run_dir=trainer.nsa_job.run_dir, mlflow_run_id=run_id, tracking_uri=uri)
