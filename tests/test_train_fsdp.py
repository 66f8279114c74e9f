"""train.parallelism=fsdp (FSDP2, torch.distributed.fsdp.fully_shard) on CPU: 2 gloo processes, no Ray.

The loop's own pieces (build_model, build_optimizer, _train_step, checkpoint.save) run sharded on 2 ranks, with
2 micro-batches per rank per step; the same model trained unsharded in one process on the same blocks (one
micro-batch of the whole global batch) must give the same losses, and the FSDP checkpoint (full state dicts,
written by rank 0) must load into that unsharded model and hold the same weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from pipeline.config import load_job_config
from pipeline.train import checkpoint as ckpt
from pipeline.train.guards import NonFiniteGuard
from pipeline.train.loop import _train_step, build_model, expected_blocks
from pipeline.train.schedule import build_optimizer, build_scheduler

pytestmark = pytest.mark.timeout(300)

SEQ_LEN, GLOBAL_BATCH, STEPS, VOCAB = 32, 4, 3, 64
MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         f"model.vocab_size={VOCAB}", f"model.max_seq_len={SEQ_LEN}", "model.nsa.cmp_block=8", "model.nsa.cmp_stride=4",
         "model.nsa.sel_block=8", "model.nsa.n_selected=3", "model.nsa.window=8", f"data.seq_len={SEQ_LEN}"]


def job(parallelism: str, num_workers: int, micro_batch: int):
    return load_job_config(None, [*MODEL, f"train.parallelism={parallelism}", f"train.num_workers={num_workers}",
                                  f"train.global_batch={GLOBAL_BATCH}", f"train.micro_batch={micro_batch}",
                                  f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=1e-2"])


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


def train(job, rank: int, world: int) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer, object]:
    t = job.train
    device = torch.device("cpu")
    model, bare = build_model(job, device) if t.parallelism == "fsdp" else (unsharded_model(job),) * 2
    optimizer = build_optimizer(bare, t, device)
    scheduler = build_scheduler(optimizer, t)
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
                                       scheduler, NonFiniteGuard(3), batches, device, NoWatchdog())
        assert finite
        losses.append(loss)
    return losses, model, optimizer, scheduler


def fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fsdp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
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
