"""What a model keeps between decoding steps (Transformer.forward_cached and decode_step).

An NSA layer keeps its raw key and value sets (rotated keys, as the core reads them) for every position so far,
and the compressed tokens made from them: the selected branch may pick any earlier block, the window reads the
last w positions, and phi turns the last l raw keys and values into a new compressed token each d positions. A
dense layer keeps its keys and values. Buffers are allocated once, at the prompt, for the model's max_seq_len
positions, and written in place; a decoding step writes at the position the cache's `position` tensor holds, on
the device, so that one CUDA graph serves every step of a kind (nsa_model/generate.py: NSA's steps that end a
compressed token, one in d, are one kind, the others the other).
"""

from __future__ import annotations

import torch


class LayerCache:
    """Buffers of one layer: `raw` [B, capacity, G, D] (the layer's key sets, then its value sets) and, for NSA,
    `compressed` [B, slots, G, D] (compressed keys, then values): Tc(capacity) slots (at least one), written by
    the steps that end a compressed token."""

    def __init__(self, step: dict | None = None) -> None:
        self.raw: list[torch.Tensor] = []
        self.compressed: list[torch.Tensor] = []
        self._step = step  # ModelCache's tensors of the current step, shared by its layers; None: none shared
        self._weights: dict[str, object] = {}
        self._weights_autocast: tuple | None = None

    def for_step(self, key: str, make):
        """make() of this step's position, made once a step for all the model's layers (they share the step's
        position and the NSA config): a dozen small kernels a layer, v68. Made every call for a LayerCache of its
        own (no ModelCache to clear it between steps)."""
        if self._step is None:
            return make()
        if key not in self._step:
            self._step[key] = make()
        return self._step[key]

    def keep_weights(self, weights: dict[str, object], device: torch.device) -> None:
        """Keep tensors made from the layer's parameters alone that every step would otherwise make again (at
        nsa-125m a concatenated projection weight, phi's stacked weights and its folded bias: eight kernels a layer,
        about a sixth of a step's GPU time, v68), with the autocast state they were made under. They are the
        parameters as of the prompt, as the cached keys and values are."""
        self._weights, self._weights_autocast = weights, _autocast_state(device)

    def kept_weights(self, device: torch.device) -> dict[str, object]:
        """What keep_weights kept, where the autocast state is the same now (their dtypes follow it); else {}: the
        step makes its own."""
        return self._weights if self._weights_autocast == _autocast_state(device) else {}

    def fill(self, raw: list[torch.Tensor], compressed: list[torch.Tensor], capacity: int, slots: int = 0) -> None:
        """New buffers holding a prompt's raw sets [B, T, G, D] and its compressed tokens [B, Tc(T), G, D]."""
        self.raw = [_buffer(x, capacity) for x in raw]
        self.compressed = [_buffer(x, slots) for x in compressed]

    def write_compressed(self, tokens: list[torch.Tensor], slot: torch.Tensor) -> list[torch.Tensor]:
        """Write one compressed token of each set, [B, 1, G, D], at `slot` (a 1-element tensor)."""
        for buffer, x in zip(self.compressed, tokens, strict=True):
            buffer.index_copy_(1, slot, x.to(buffer.dtype))
        return self.compressed


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _buffer(x: torch.Tensor, size: int) -> torch.Tensor:
    buffer = x.new_zeros(x.shape[0], size, *x.shape[2:])
    buffer[:, :x.shape[1]] = x
    return buffer


class ModelCache:
    """A model's decoding state: one LayerCache a layer, `length` positions held and the prompt's `batch` rows (on
    the host: what decides whether a token fits), and `position`, a 1-element int64 tensor on the model's device:
    the position the next decoding step writes and reads. Transformer.forward_cached sets it to `length` before
    each step (DecodingSteps before each replay of its graph, which reads it anew)."""

    def __init__(self, num_layers: int, capacity: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"ModelCache.capacity: must be >= 1 position, got {capacity}")
        self.step: dict[str, object] = {}  # LayerCache.for_step's tensors; cleared by new_step
        self.layers = [LayerCache(self.step) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0
        self.batch = 0
        self.position = torch.zeros(1, dtype=torch.long, device=device)

    def new_step(self) -> None:
        """Forget the last step's shared tensors (Transformer.decode_step, before its layers run)."""
        self.step.clear()

    def repeat_rows(self, rows: int) -> None:
        """Hold `rows` copies of the one-row prompt this cache holds, each of which its own decoding steps then
        extend: samples of one prompt (nsa_model/generate.py) run the prompt once instead of once a sample. Each
        row gets buffers of its own, since each writes its own tokens."""
        if type(rows) is not int or rows < 1:
            raise ValueError(f"ModelCache.repeat_rows: rows must be an int >= 1, got {rows!r}")
        if self.length == 0 or self.batch != 1:
            raise ValueError(f"ModelCache.repeat_rows: needs a cache holding a one-row prompt, this one holds "
                             f"{self.length} positions of {self.batch} rows")
        for layer in self.layers:
            layer.raw = [x.expand(rows, *x.shape[1:]).contiguous() for x in layer.raw]
            layer.compressed = [x.expand(rows, *x.shape[1:]).contiguous() for x in layer.compressed]
        self.batch = rows

    def room_for(self, new: int, batch: int | None = None) -> None:
        """Refuse what this cache cannot take: a prompt goes into an empty cache, then one token a call for each of
        the prompt's rows, up to capacity positions."""
        if new < 1:
            raise ValueError(f"forward_cached: needs at least one token, got {new}")
        if self.length and batch is not None and batch != self.batch:
            raise ValueError(f"forward_cached: the cache holds {self.batch} rows (its prompt's batch), got a step "
                             f"of {batch}")
        if self.length and new != 1:
            raise ValueError(f"forward_cached: a cache holding {self.length} positions takes one token a call, "
                             f"got {new} (start a new cache for a new prompt)")
        if self.length + new > self.capacity:
            raise ValueError(f"forward_cached: {self.length} cached + {new} new positions exceed the cache's "
                             f"{self.capacity} (the model's max_seq_len); crop the context and start a new cache")
