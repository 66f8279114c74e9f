"""The worker side: turning this rank's own block stream into its micro-batches.

Scheme (docs/DESIGN.md, "Data -> trainer"): the input is dealt to the W ranks before training starts
(pipeline/data/shards.py): streaming, the (file, row group) fragments of the source; prepared, the row groups of
the packed shards; each piece to exactly one rank, deterministically (seeded file order, greedy balance by
size, ties to the lowest rank), the shares near-equal. The trainer gets one dataset per rank and split
(`train_<r>`, `val_<r>`, rank_dataset_name), each reading only its rank's pieces: when streaming, rank r's
pipeline reads, cleans, tokenizes and packs only its own fragments, and its blocks are numbered by their
position in its own stream. Ray Train's DataConfig(datasets_to_split=[]) hands every worker the datasets
unsplit; a worker iterates only its own, so only that pipeline executes.

Rank r takes its blocks in order, `micro_batch` at a time: optimizer step s uses positions
[s*PB, (s+1)*PB) of every rank's stream, PB = global_batch / W. The data position of a checkpoint is one number,
the blocks each rank consumed (the same for every rank), valid for that world size only (the shares depend on
W: a checkpoint refuses to resume under another one). Every rank runs the same number of steps, fixed up front:
a rank whose share runs out continues into its next epoch (the same stream again, from its first block; the
positions keep counting), so no rank ever waits on another's uneven share; the wrap is logged.

Trade-offs. A resumed streaming run re-tokenizes its rank's share up to the resume position (the packer is
sequential; only the blocks are skipped), as the whole-stream scheme did for the whole stream; prepared data
skips by row group. Shares are balanced by size (text bytes, blocks), not exactly equal; the shortest share
bounds how far a run goes before its rank wraps. A wrap starts the rank's stream again, and the next batch waits
for its pipeline to produce a first block: 5-7 s for a streamed share of the stdlib corpus on a 2-GPU host
(bench/results/train-summary.md), the other ranks waiting in the next all-reduce; a corpus larger than the run
never pays it. Ray Data's streaming_split would also give disjoint reads, but hands blocks to whichever rank
asks first, so which block lands in which step would depend on timing and resume could not be exact.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import numpy as np
import torch


def train_data_config():
    """Ray Train's DataConfig for this scheme: no splitting (each rank has its own datasets), order preserved."""
    from ray.data import ExecutionOptions
    from ray.train import DataConfig as RayTrainDataConfig
    return RayTrainDataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


def rank_dataset_name(split: str, rank: int) -> str:
    """The trainer's dataset of `rank`'s share of `split` (ray.train.get_dataset_shard(name) on that rank)."""
    return f"{split}_{rank}"


def iter_rank_batches(data, *, batch_size: int, start_block: int = 0, wrap: bool = False,
                      prefetch_batches: int = 1,
                      on_epoch: Callable[[int, int], None] | None = None
                      ) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """Yield (LongTensor [batch_size, seq_len + 1], int64 positions [batch_size]) from this rank's stream.

    `data` is what ray.train.get_dataset_shard(name) returns (a DataIterator) or a ray.data.Dataset of this
    rank's block rows (pipeline.data.dataset.block_dataset) in index order. A position counts this rank's blocks
    from the start of its first epoch; batches start at position start_block.

    wrap=False: one pass; a final incomplete batch is not yielded. wrap=True: when the stream ends, it is
    iterated again (the next epoch; on_epoch(epoch, blocks so far) is called first), forever: the caller takes
    the batches it needs. Every epoch must then be the whole stream from index 0, of the same length.
    Without wrap, the stream may begin at any index up to start_block (a dataset built from a resume position).
    A lost, repeated or reordered block is an error, never silently trained on.
    """
    _check_args(batch_size, start_block)
    base = 0  # position of the current epoch's block 0
    length = None  # blocks per epoch, once an epoch has ended
    held_pos, held_tok = np.empty(0, np.int64), None  # blocks of the current, incomplete batch
    for epoch in itertools.count():
        if epoch and on_epoch is not None:
            on_epoch(epoch, base)
        expected = None  # the index the stream must deliver next
        for batch in data.iter_batches(batch_size=batch_size, batch_format="numpy", prefetch_batches=prefetch_batches):
            index, tokens = batch["index"], batch["tokens"]
            if len(index) == 0:
                continue
            if expected is None:
                if index[0] != 0 and (wrap or epoch or index[0] > start_block):
                    raise RuntimeError(f"block stream of epoch {epoch} starts at block {int(index[0])}, expected "
                                       f"{'0' if wrap or epoch else f'at most {start_block}'}")
                expected = int(index[0])
            if not np.array_equal(index, np.arange(expected, expected + len(index))):
                raise RuntimeError(f"block stream out of order: expected blocks from {expected}, got "
                                   f"{index[:8].tolist()}...; is preserve_order set (train_data_config())?")
            expected += len(index)
            position = base + index
            keep = position >= start_block  # resume: the blocks before start_block were trained on
            if keep.any():
                held_pos = np.concatenate([held_pos, position[keep]])
                held_tok = tokens[keep] if held_tok is None else np.concatenate([held_tok, tokens[keep]])
            while len(held_pos) >= batch_size:
                yield torch.from_numpy(held_tok[:batch_size].astype(np.int64)), held_pos[:batch_size]
                held_pos, held_tok = held_pos[batch_size:], held_tok[batch_size:]
        if not wrap:
            return
        blocks = expected or 0
        if blocks == 0:
            raise RuntimeError("this rank's share of the split holds no full block, so no epoch of it can feed a "
                               "batch; add data or use fewer workers")
        if length is not None and blocks != length:
            raise RuntimeError(f"epoch {epoch} of this rank's stream held {blocks} blocks, epoch 0 held {length}: "
                               f"the stream is not deterministic")
        length = blocks
        base += blocks


def _check_args(batch_size: int, start_block: int) -> None:
    for name, value, low in (("batch_size", batch_size, 1), ("start_block", start_block, 0)):
        if not (isinstance(value, (int, np.integer)) and value >= low):
            raise ValueError(f"iter_rank_batches: {name} must be an int >= {low}, got {value!r}")
