"""The checkpoint: everything needed to continue the same run, loaded without unpickling arbitrary objects.

A checkpoint directory holds
    train_state.pt   rank 0: model and optimizer (full, unsharded state dicts), scheduler, step, the data
                     position (rank_blocks, world_size), guard counters; tensors and plain values only, read
                     back with torch.load(weights_only=True)
    rng_rank<r>.pt   every rank: its torch CPU (and CUDA) generator states
    config.yaml      rank 0: the resolved JobConfig of the run that wrote it
Ray Train merges the files that every rank reports into one directory in persistent storage.
The data position: every rank consumed `rank_blocks = step * global_batch / world_size` blocks of its own share,
and the resumed run continues each rank's stream at that position (DESIGN.md, "Data -> trainer"). The shares are
dealt by world size, so a checkpoint resumes only under the world size that wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

TRAIN_STATE = "train_state.pt"
CONFIG_FILE = "config.yaml"
MODEL_FILE = "model.pt"  # the final weights alone, as the run logs them to MLflow (its `model` artifact)
CHECKPOINT_PREFIX = "checkpoint_step_"  # + the step, 8 digits: a run directory's checkpoints sort by step
FORMAT_VERSION = 2  # 2: per-rank data shares (rank_blocks, world_size); 1 held one global next_block


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


@dataclass
class TrainingPosition:
    step: int  # optimizer steps done; the next step to run
    rank_blocks: int  # blocks of its own share every rank consumed: its next block's position
    world_size: int  # the ranks the data was dealt to
    guard: dict[str, int]


def _full_options() -> StateDictOptions:
    # Full (unsharded) state on CPU: the same file for DDP and FSDP2, any world size can load it.
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def rng_state() -> dict[str, Any]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def save(directory: Path, *, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, position: TrainingPosition, config_yaml: str) -> None:
    """Every rank calls this (the state-dict gathers are collectives under FSDP); rank 0 writes the shared files."""
    model_state = get_model_state_dict(model, options=_full_options())
    optim_state = get_optimizer_state_dict(model, optimizer, options=_full_options())
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), directory / rng_file(rank))
    if rank == 0:
        torch.save({"format_version": FORMAT_VERSION, "model": model_state, "optimizer": optim_state,
                    "scheduler": scheduler.state_dict(), "step": position.step,
                    "rank_blocks": position.rank_blocks, "world_size": position.world_size,
                    "guard": position.guard}, directory / TRAIN_STATE)
        (directory / CONFIG_FILE).write_text(config_yaml)


def load(directory: Path, *, rank: int, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: torch.optim.lr_scheduler.LRScheduler, global_batch: int) -> TrainingPosition:
    """Restore model, optimizer, scheduler and this rank's RNG; return where training continues.

    Refuses (ValueError) a checkpoint whose data position cannot be continued exactly: written by another world
    size (the ranks' data shares differ), with another global batch, or in the format before per-rank shares."""
    path = directory / TRAIN_STATE
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {directory} has no {TRAIN_STATE}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {directory}: format {state.get('format_version')}, expected {FORMAT_VERSION}"
                         + (" (format 1 was written when every rank read the whole block stream; its data position "
                            "does not say where each rank's own share continues)" if state.get("format_version") == 1
                            else ""))
    if state["world_size"] != world_size:
        raise ValueError(f"checkpoint {directory} was written by a run of {state['world_size']} workers, this run has "
                         f"{world_size}: each worker reads its own share of the data, dealt by the number of "
                         f"workers, so the data position cannot be continued exactly under another count; resume "
                         f"with train.num_workers={state['world_size']} (or start a new train.run_name)")
    if state["rank_blocks"] * world_size != state["step"] * global_batch:
        raise ValueError(f"checkpoint {directory}: {state['rank_blocks']} blocks per rank after step {state['step']} "
                         f"!= step * global_batch {global_batch} / {world_size} workers; resuming with a different "
                         f"global batch is not exact")
    set_model_state_dict(model, state["model"], options=_full_options())
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_full_options())
    scheduler.load_state_dict(state["scheduler"])
    rng_path = directory / rng_file(rank)
    if not rng_path.exists():
        raise FileNotFoundError(f"checkpoint {directory} has no RNG state for rank {rank}")
    set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True))
    return TrainingPosition(step=int(state["step"]), rank_blocks=int(state["rank_blocks"]),
                            world_size=int(state["world_size"]), guard={k: int(v) for k, v in state["guard"].items()})


def load_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint (for evaluation or export), without unpickling objects."""
    return torch.load(Path(directory) / TRAIN_STATE, map_location="cpu", weights_only=True)["model"]


def trained_model_dir(source: Path) -> Path:
    """The directory holding a trained model's weights and config.yaml: `source` itself when it is a checkpoint
    (train_state.pt) or a logged final model (model.pt, the MLflow `model` artifact), else the latest
    checkpoint of `source` as a run directory (its checkpoint_step_* folders)."""
    source = Path(source)
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: not a directory (expected a checkpoint, a run directory or a "
                                f"model directory holding {MODEL_FILE})")
    if (source / TRAIN_STATE).exists() or (source / MODEL_FILE).exists():
        directory = source
    else:
        checkpoints = sorted(p for p in source.glob(CHECKPOINT_PREFIX + "*") if p.is_dir())
        if not checkpoints:
            raise FileNotFoundError(f"{source}: holds neither {TRAIN_STATE}, {MODEL_FILE} nor any "
                                    f"{CHECKPOINT_PREFIX}* checkpoint")
        directory = checkpoints[-1]
        if not (directory / TRAIN_STATE).exists():  # e.g. a copy cut short
            raise FileNotFoundError(f"{directory}: the latest checkpoint of {source} has no {TRAIN_STATE}")
    if not (directory / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{directory}: has no {CONFIG_FILE}, so the model it holds cannot be rebuilt")
    return directory


def load_trained_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The model state dict in a directory that trained_model_dir returned, without unpickling objects."""
    if (directory / TRAIN_STATE).exists():
        return load_model_weights(directory)
    return torch.load(directory / MODEL_FILE, map_location="cpu", weights_only=True)
