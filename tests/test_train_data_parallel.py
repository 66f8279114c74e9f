"""Data parallelism on CPU without Ray: 2 gloo processes run the loop's own pieces (build_model, build_optimizer,
FlatGradients, _train_step, checkpoint.save) with 2 micro-batches per rank per step. The same model trained in one
process on the same blocks (one micro-batch of the whole global batch) must give the same losses.

- train.parallelism=fsdp (FSDP2, torch.distributed.fsdp.fully_shard): the FSDP checkpoint (full state dicts,
  written by rank 0) must load into that unsharded model and hold the same weights.
- train.parallelism=allreduce (replicas, one all-reduce of a flat gradient buffer per step): rank 1 starts from
  other weights (another seed) and build_model must hand it rank 0's; both ranks end with the same weights.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import pytest
import torch

from pipeline.config import load_job_config
from pipeline.train import checkpoint as ckpt
from pipeline.train.guards import NonFiniteGuard
from pipeline.train.loop import FlatGradients, _train_step, build_model, expected_blocks
from pipeline.train.schedule import build_optimizer, build_scheduler

pytestmark = pytest.mark.timeout(300)

SEQ_LEN, GLOBAL_BATCH, STEPS, VOCAB = 32, 4, 3, 64
MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         f"model.vocab_size={VOCAB}", f"model.max_seq_len={SEQ_LEN}", "model.nsa.cmp_block=8", "model.nsa.cmp_stride=4",
         "model.nsa.sel_block=8", "model.nsa.n_selected=3", "model.nsa.window=8", f"data.seq_len={SEQ_LEN}"]


def job(parallelism: str, num_workers: int, micro_batch: int, seed: int = 1337):
    return load_job_config(None, [*MODEL, f"train.parallelism={parallelism}", f"train.num_workers={num_workers}",
                                  f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={micro_batch}",
                                  f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=1e-2",
                                  f"train.seed={seed}"])


def all_blocks() -> torch.Tensor:
    """Global block i of the run: row i (every rank builds the same table)."""
    return torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(5))


class NoWatchdog:
    def beat(self, step, phase):
        pass


def unsharded_model(job, seed: int | None = None) -> torch.nn.Module:
    """What build_model makes on every rank before wrapping (DDP needs a Ray Train session, so not it here)."""
    from nsa_model.model import Transformer

    torch.manual_seed(job.train.seed if seed is None else seed)
    return Transformer(job.model)


def train(job, rank: int, world: int, start: dict | None = None
          ) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer, object]:
    """STEPS optimizer steps; `start` receives the weights the model starts from (after build_model)."""
    t = job.train
    device = torch.device("cpu")
    model, bare = build_model(job, device) if world > 1 else (unsharded_model(job),) * 2
    if start is not None:
        start.update({k: v.clone() for k, v in bare.state_dict().items()})
    optimizer = build_optimizer(bare, t, device)
    scheduler = build_scheduler(optimizer, t)
    grads = FlatGradients(optimizer) if t.parallelism == "allreduce" and world > 1 else None
    data = all_blocks()
    batches = []
    for step in range(STEPS):
        for micro in range(t.grad_accum):
            idx = expected_blocks(step, micro, rank=rank, world=world, micro_batch=t.micro_batch,
                                  global_batch=t.global_batch)
            batches.append((data[idx], idx))
    batches = iter(batches)
    losses = []
    for step in range(STEPS):
        loss, finite, *_ = _train_step(t, step, rank, world, model, model, contextlib.nullcontext(), optimizer,
                                       scheduler, NonFiniteGuard(3), batches, device, NoWatchdog(), grads=grads)
        assert finite
        losses.append(loss)
    return losses, model, optimizer, scheduler


def spawn_two(worker, out: Path) -> None:
    """worker(rank, world, port, out) in 2 processes of one gloo group on a free port."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, str(out)), nprocs=2, join=True)


def join_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    join_group(rank, world, port)
    try:
        fsdp_job = job("fsdp", world, 1)
        assert fsdp_job.train.grad_accum == 2  # accumulation over micro-batches, sharded
        losses, model, optimizer, scheduler = train(fsdp_job, rank, world)
        from torch.distributed.tensor import DTensor

        assert all(isinstance(p, DTensor) for p in model.parameters())  # really sharded
        ckpt.save(Path(out) / "ckpt", rank=rank, model=model, optimizer=optimizer, scheduler=scheduler,
                  position=ckpt.TrainingPosition(step=STEPS, rank_blocks=STEPS * GLOBAL_BATCH // world,
                                                 world_size=world, guard={"skipped_total": 0, "consecutive": 0}),
                  config_yaml=fsdp_job.to_yaml())
        (Path(out) / f"losses{rank}.json").write_text(json.dumps(losses))
    finally:
        dist.destroy_process_group()


def test_fsdp2_trains_like_one_unsharded_process_and_checkpoints_full_state(tmp_path):
    spawn_two(fsdp_worker, tmp_path)
    sharded = [json.loads((tmp_path / f"losses{r}.json").read_text()) for r in (0, 1)]
    assert sharded[0] == sharded[1]  # the all-reduced loss of each step

    single_job = job("ddp", 1, GLOBAL_BATCH)
    torch.set_num_threads(1)
    reference, model, optimizer, scheduler = train(single_job, 0, 1)
    assert reference[0] != reference[-1]  # it trained
    assert sharded[0] == pytest.approx(reference, rel=1e-5)

    # The FSDP checkpoint holds full (unsharded) state: it loads into the single-process model as it is.
    fresh = job("ddp", 1, GLOBAL_BATCH)
    bare2 = unsharded_model(fresh, seed=fresh.train.seed + 1)  # another init: the weights must come from the file
    opt2 = build_optimizer(bare2, fresh.train, torch.device("cpu"))
    sched2 = build_scheduler(opt2, fresh.train)
    # (world_size=2: the data position is the 2-worker run's; the weights load into any model)
    pos = ckpt.load(tmp_path / "ckpt", rank=0, world_size=2, model=bare2, optimizer=opt2, scheduler=sched2,
                    global_batch=GLOBAL_BATCH)
    assert (pos.step, pos.rank_blocks, pos.world_size) == (STEPS, STEPS * GLOBAL_BATCH // 2, 2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.yaml", "rng_rank0.pt", "rng_rank1.pt", "train_state.pt"]  # the RNG of every rank
    want = model.state_dict()
    for name, value in bare2.state_dict().items():
        # Adam turns fp32 reduction-order noise (sharded vs not) into weight differences of ~1e-5 after 3 steps;
        # a wrong or missing update moves a weight by about lr = 1e-2.
        torch.testing.assert_close(value, want[name], rtol=0, atol=1e-4, msg=name)
    assert sched2.get_last_lr() == scheduler.get_last_lr()


def allreduce_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    join_group(rank, world, port)
    try:
        replica_job = job("allreduce", world, 1, seed=1337 + rank)  # rank 1 would start elsewhere on its own
        assert replica_job.train.grad_accum == 2
        start = {}
        losses, model, *_ = train(replica_job, rank, world, start=start)
        torch.save({"losses": losses, "state": model.state_dict(), "start": start}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_allreduce_replicas_train_like_one_process_and_stay_identical(tmp_path):
    spawn_two(allreduce_worker, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]

    torch.set_num_threads(1)
    reference, model, *_ = train(job("ddp", 1, GLOBAL_BATCH), 0, 1)
    assert reference[0] != reference[-1]  # it trained
    # Rank 1 started from rank 0's weights, which are the single process's (same seed), not its own seed's.
    for name, value in ranks[1]["start"].items():
        torch.testing.assert_close(value, ranks[0]["start"][name], rtol=0, atol=0)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the all-reduced loss of each step
    assert ranks[0]["losses"] == pytest.approx(reference, rel=1e-5)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][name], ranks[1]["state"][name], rtol=0, atol=0)  # replicas
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=0, atol=1e-4, msg=name)  # as for FSDP
