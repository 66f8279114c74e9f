"""AdamW and its learning-rate schedule, both counted in optimizer steps.

Step s (0-based) trains with lr_at(s): a linear warmup reaching the peak `lr` at the last warmup step
(s = warmup_steps - 1), then cosine (or WSD: stable, then a linear decay over the last decay_fraction of the
steps) down to `min_lr` at the last step (s = max_steps - 1). The scheduler is a torch LambdaLR stepped once
per optimizer step, including steps skipped by the non-finite guard, so LR and data position stay tied to s.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pipeline.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    last = cfg.max_steps - 1
    if cfg.schedule == "cosine":
        span = last - cfg.warmup_steps
        progress = 1.0 if span <= 0 else min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    # wsd: stable at lr, then linear to min_lr over the last decay steps
    decay_steps = max(1, math.ceil(cfg.decay_fraction * (cfg.max_steps - cfg.warmup_steps)))
    decay_start = last - decay_steps
    if step <= decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / decay_steps)
    return cfg.lr + (cfg.min_lr - cfg.lr) * progress


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: no decay on norms, biases (1-D) and embeddings (token and position tables)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # shared (tied) parameters appear once
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embedding_ids or "embed" in name.split(".")[-1] or "pos_emb" in name
        (decay if p.ndim >= 2 and not is_embedding else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for every parameter, on CUDA and on CPU): the fused form also skips a non-finite
    step on the device (pipeline/train/loop.py, skips_on_device). FSDP on CPU keeps the foreach form."""
    fused = device.type == "cuda" or cfg.parallelism != "fsdp"
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=fused)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR multiplies the group's initial lr (cfg.lr) by the factor; a plain function keeps its state_dict
    # free of callables (checkpoints load with weights_only=True).
    def factor(step: int) -> float:
        return lr_at(step, cfg) / cfg.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
