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
        # Not persistent: they are a pure function of the config, so checkpoints do not carry them.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.max_seq_len = max_seq_len

    def check_positions(self, position: int, T: int) -> None:
        if position < 0:
            raise ValueError(f"RoPE: position must be >= 0, got {position}")
        if position + T > self.max_seq_len:
            raise ValueError(f"RoPE: sequence length {T} from position {position} exceeds max_seq_len "
                             f"{self.max_seq_len}")

    def tables(self, position: int | torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, D/2] of positions position .. position + T - 1. A tensor position (a decoding step's,
        on the device) is read by an index, not by the host: its caller keeps it in range (LayerCache)."""
        if isinstance(position, torch.Tensor):  # a decoding step's one row needs no range built (two kernels)
            rows = position.reshape(1) if T == 1 else position.reshape(1) + torch.arange(T, device=position.device)
            return self.cos.index_select(0, rows), self.sin.index_select(0, rows)
        self.check_positions(position, T)
        return self.cos[position:position + T], self.sin[position:position + T]

    def forward(self, x: torch.Tensor, position: int | torch.Tensor = 0) -> torch.Tensor:
        """x's rows rotated as positions position .. position + T - 1 (position > 0: tokens after a cached
        context, Transformer.forward_cached)."""
        cos, sin = self.tables(position, x.shape[1])
        cos, sin = cos[:, None, :], sin[:, None, :]
        # float32 at least (bf16 angles lose positions), float64 stays float64
        x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated.to(x.dtype)
