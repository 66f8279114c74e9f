"""Check that a Ray cluster can run a multi-node Ray Train job, before spending GPU hours on one.

Runs a TorchTrainer whose workers each join the process group, all-reduce a tensor holding
their rank, and report where they ran. The driver prints one JSON line with the result:

    RAY_ADDRESS=127.0.0.1:6379 python cluster/smoke_train.py --num-workers 2 --cpus-per-worker 1
    python cluster/smoke_train.py --num-workers 16 --gpus-per-worker 1 --storage-path s3://bucket/ray

The job fails (non-zero exit) if the all-reduce gives the wrong sum, so a cluster whose nodes
cannot reach each other over the collective backend (NCCL on GPUs, gloo on CPUs) is caught here.
It joins the cluster named by RAY_ADDRESS (or `ray job submit`), else starts a local one.
"""

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer


@dataclass(frozen=True)
class SmokeConfig:
    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    storage_path: str | None
    name: str

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1, got {self.num_workers}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"--cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")


def train_loop_per_worker(config: dict) -> None:
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()  # this worker's GPU (set as current for NCCL), or the CPU
    value = torch.tensor([float(rank)], device=device)
    dist.all_reduce(value)  # the process group is set up by TorchTrainer (NCCL on GPU, gloo on CPU)
    # Only rank 0's metrics reach the driver, so gather every rank's node id through a collective.
    node_ids = [None] * world_size
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    summary = {"world_size": world_size, "allreduce_sum": value.item(), "node_ids": node_ids, "device": str(device)}
    # Ray Train returns the metrics of the last reported checkpoint, and writing one also checks that
    # the storage path is reachable from the workers (shared storage is required across nodes).
    # Every rank reports once; only rank 0 attaches the checkpoint.
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        checkpoint = None
        if rank == 0:
            with open(os.path.join(checkpoint_dir, "smoke.json"), "w") as f:
                json.dump(summary, f)
            checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir)
        ray.train.report(summary, checkpoint=checkpoint)


def run_smoke(cfg: SmokeConfig) -> dict:
    scaling = ray.train.ScalingConfig(
        num_workers=cfg.num_workers,
        use_gpu=cfg.gpus_per_worker > 0,
        resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": cfg.gpus_per_worker} if cfg.gpus_per_worker else {})},
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        scaling_config=scaling,
        run_config=ray.train.RunConfig(name=cfg.name, storage_path=cfg.storage_path),
    )
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError("the smoke training run failed") from result.error
    metrics = result.metrics
    expected_sum = cfg.num_workers * (cfg.num_workers - 1) / 2
    if metrics["allreduce_sum"] != expected_sum:
        raise RuntimeError(f"all-reduce over {cfg.num_workers} workers gave {metrics['allreduce_sum']}, expected {expected_sum}")
    node_ids = metrics["node_ids"]
    return {"ok": True, "world_size": metrics["world_size"], "node_ids": node_ids, "num_nodes": len(set(node_ids)), "config": asdict(cfg)}


def parse_args(argv: list[str]) -> SmokeConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--storage-path", default=None, help="shared storage for Ray Train (s3://, gs://, or a path every node sees)")
    parser.add_argument("--name", default="cluster-smoke")
    args = parser.parse_args(argv)
    return SmokeConfig(args.num_workers, args.cpus_per_worker, args.gpus_per_worker, args.storage_path, args.name)


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    ray.init()  # RAY_ADDRESS or `ray job submit` names the cluster; otherwise a local one
    summary = run_smoke(cfg)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
