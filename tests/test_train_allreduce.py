"""train.parallelism=allreduce on CPU: 2 gloo processes, no Ray.

The loop's own pieces (build_model, FlatGradients, _train_step) run on 2 ranks with 2 micro-batches per rank per
step. Rank 1 starts from other weights (another seed): build_model must hand it rank 0's. The same model trained in
one process on the same blocks (one micro-batch of the whole global batch) must give the same losses and weights.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import pytest
import torch

from pipeline.config import load_job_config
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


class NoWatchdog:
    def beat(self, step, phase):
        pass


def train(job, rank: int, world: int, start: dict | None = None) -> tuple[list[float], dict]:
    """STEPS optimizer steps of the loop's pieces; `start` (rank 0 only) receives the weights it starts from."""
    t = job.train
    device = torch.device("cpu")
    model, bare = build_model(job, device)
    if start is not None:
        start.update({k: v.clone() for k, v in bare.state_dict().items()})
    optimizer = build_optimizer(bare, t, device)
    scheduler = build_scheduler(optimizer, t)
    grads = FlatGradients(optimizer) if world > 1 else None  # the reference keeps autograd's own gradients
    data = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(5))
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
    return losses, bare.state_dict()


def allreduce_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        replica_job = job("allreduce", world, 1, seed=1337 + rank)  # rank 1 would start elsewhere on its own
        assert replica_job.train.grad_accum == 2
        start = {}
        losses, state = train(replica_job, rank, world, start=start)
        torch.save({"losses": losses, "state": state, "start": start}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_allreduce_replicas_train_like_one_process_and_stay_identical(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(allreduce_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]

    torch.set_num_threads(1)
    single = job("allreduce", 1, GLOBAL_BATCH)  # one process: nothing to reduce
    reference, reference_state = train(single, 0, 1)
    assert reference[0] != reference[-1]  # it trained
    # Rank 1 started from rank 0's weights, which are the single process's (same seed), not its own seed's.
    for name, value in ranks[1]["start"].items():
        torch.testing.assert_close(value, ranks[0]["start"][name], rtol=0, atol=0)
    assert json.dumps(ranks[0]["losses"]) == json.dumps(ranks[1]["losses"])  # the all-reduced loss of each step
    assert ranks[0]["losses"] == pytest.approx(reference, rel=1e-5)
    for name, value in reference_state.items():
        torch.testing.assert_close(ranks[0]["state"][name], ranks[1]["state"][name], rtol=0, atol=0)  # replicas
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-3, atol=1e-4)  # Adam: lr-sized on tiny grads
