"""What one attention layer keeps between decoding steps (Transformer.forward_cached).

An NSA layer keeps its raw key and value sets (rotated keys, as the core reads them) for every position so far,
and the compressed tokens made from them. The selected branch may pick any earlier block, so every raw position
stays; the window reads the last w of them; phi turns the last l raw keys and values into a new compressed token
each d positions. A dense layer keeps its keys and values. Buffers are allocated once, for the model's
max_seq_len positions, and written in place.
"""

from __future__ import annotations

import torch


class LayerCache:
    """Buffers of one layer: `raw` [B, capacity, G, D] tensors (the layer's key sets, then its value sets) and,
    for NSA, `compressed` [B, Tc(capacity), G, D] tensors (compressed keys, then values); `length` positions held."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LayerCache.capacity: must be >= 1 position, got {capacity}")
        self.capacity = capacity
        self.length = 0
        self.num_compressed = 0
        self.raw: list[torch.Tensor] = []
        self.compressed: list[torch.Tensor] = []

    def room_for(self, new: int) -> int:
        """The position of the first of `new` tokens, after refusing what this cache cannot take: a prompt goes
        into an empty cache, then one token a call, up to capacity positions."""
        if new < 1:
            raise ValueError(f"forward_cached: needs at least one token, got {new}")
        if self.length and new != 1:
            raise ValueError(f"forward_cached: a cache holding {self.length} positions takes one token a call, "
                             f"got {new} (start a new cache for a new prompt)")
        if self.length + new > self.capacity:
            raise ValueError(f"forward_cached: {self.length} cached + {new} new positions exceed the cache's "
                             f"{self.capacity} (the model's max_seq_len); crop the context and start a new cache")
        return self.length

    def fill(self, raw: list[torch.Tensor], compressed: list[torch.Tensor], capacity_compressed: int = 0) -> None:
        """Store a prompt's raw sets [B, T, G, D] and its compressed tokens [B, Tc, G, D] in new buffers."""
        self.raw = [self._buffer(x, self.capacity) for x in raw]
        self.compressed = [self._buffer(x, capacity_compressed) for x in compressed]
        self.length = raw[0].shape[1]
        self.num_compressed = compressed[0].shape[1] if compressed else 0

    def append(self, raw: list[torch.Tensor]) -> list[torch.Tensor]:
        """Write one position's raw sets [B, 1, G, D]; return every set's positions so far, [B, length, G, D]."""
        for buffer, x in zip(self.raw, raw, strict=True):
            buffer[:, self.length] = x[:, 0]
        self.length += 1
        return [buffer[:, :self.length] for buffer in self.raw]

    def append_compressed(self, tokens: list[torch.Tensor]) -> None:
        """Write one compressed token of each set, [B, 1, G, D]."""
        for buffer, x in zip(self.compressed, tokens, strict=True):
            buffer[:, self.num_compressed] = x[:, 0]
        self.num_compressed += 1

    def compressed_so_far(self) -> list[torch.Tensor]:
        return [buffer[:, :self.num_compressed] for buffer in self.compressed]

    @staticmethod
    def _buffer(x: torch.Tensor, capacity: int) -> torch.Tensor:
        buffer = x.new_zeros(x.shape[0], capacity, *x.shape[2:])
        buffer[:, :x.shape[1]] = x
        return buffer
