"""Sequential packing of a token stream into fixed blocks of seq_len + 1 tokens.

Documents follow each other with one EOS after each; a document may span blocks; nothing is padded.
The packer keeps the tail that does not fill a block and prepends it to the next input, so no token is
lost or duplicated at any batch boundary; the tail left at the end of the stream is the final partial block.
"""

from __future__ import annotations

import numpy as np


def block_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else int32 (half the memory and disk for vocabularies <= 65536)."""
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.int32)


class BlockPacker:
    def __init__(self, block_len: int, dtype: np.dtype):
        self.block_len = block_len
        self.dtype = np.dtype(dtype)
        self.next_index = 0  # global index of the next full block
        self._tail = np.empty(0, dtype=self.dtype)

    @property
    def tail_tokens(self) -> int:
        return len(self._tail)

    def push(self, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append tokens; return (indices [k] int64, blocks [k, block_len]) of the blocks now complete."""
        if len(stream) and (stream.min() < 0 or stream.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside {self.dtype} range: [{stream.min()}, {stream.max()}]")
        data = np.concatenate([self._tail, stream.astype(self.dtype, copy=False)])
        k = len(data) // self.block_len
        blocks = data[: k * self.block_len].reshape(k, self.block_len)
        self._tail = data[k * self.block_len:].copy()
        indices = np.arange(self.next_index, self.next_index + k, dtype=np.int64)
        self.next_index += k
        return indices, blocks
