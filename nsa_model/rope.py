"""Rotary position embedding (RoPE), Llama's rotate-half convention."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables for positions 0 .. max_seq_len - 1 and rotates [B, T, heads, D] tensors.

    Dimension i < D/2 pairs with i + D/2 and the pair turns by the angle t * theta^(-2i/D):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding.head_dim: must be even, got {head_dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # [T, D/2]
        # Full-width tables, sin signed per half, so the rotation is x * cos + swap_halves(x) * sin: elementwise
        # ops and an index remap, no concatenation. Under torch.compile the backward of a concatenated rotation
        # was a float32 buffer per q and K/V set, copied again into the q/k/v gradient; without it the RoPE
        # backward writes straight into that gradient (kernels-notes.md, v18).
        # Not persistent: they are a pure function of the config, so checkpoints do not carry them.
        self.register_buffer("cos", angles.cos().repeat(1, 2).float(), persistent=False)
        self.register_buffer("sin", torch.cat([-angles.sin(), angles.sin()], dim=-1).float(), persistent=False)
        self.max_seq_len = max_seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, D = x.shape[1], x.shape[-1]
        if T > self.max_seq_len:
            raise ValueError(f"RoPE: sequence length {T} exceeds max_seq_len {self.max_seq_len}")
        cos = self.cos[:T, None, :]
        sin = self.sin[:T, None, :]
        # float32 at least (bf16 angles lose positions), float64 stays float64
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        swapped = xf.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)  # (x2, x1)
        return (xf * cos + swapped * sin).to(x.dtype)
