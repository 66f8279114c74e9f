"""The worker side: turning the ordered block stream into this rank's batches.

Scheme (docs/DESIGN.md): global micro-batch t holds blocks [t*b*W, (t+1)*b*W); rank r of W takes those
with index % W == r, so optimizer step s (grad_accum micro-batches) uses global blocks
[s*GB, (s+1)*GB), GB = b * W * grad_accum, and a checkpoint's data position is one number.

Trade-off: every rank iterates the whole ordered stream (Ray Train DataConfig(datasets_to_split=[]))
and keeps only its blocks. That makes the assignment of blocks to ranks and steps exact and resumable,
at the cost of each rank reading the other ranks' blocks too. Ray Data's streaming_split would give each
rank a disjoint read, but hands blocks to whichever rank asks first, so which block lands in which step
would depend on timing and resume could not be exact. With prepared data (packed_dir) the extra reading
is only Parquet decoding of already packed tokens; when streaming from text, every rank also tokenizes
the whole stream, so prepare the data first (jobs/prepare_data.py) for multi-worker runs at scale.
Every rank yields the same number of batches: a micro-batch is yielded only once the stream has shown
that all W ranks can complete it.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import ray
import torch


def train_data_config():
    """Ray Train's DataConfig for this scheme: no splitting, order preserved."""
    from ray.data import ExecutionOptions
    from ray.train import DataConfig as RayTrainDataConfig
    return RayTrainDataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


def iter_rank_batches(data, *, rank: int, world_size: int, batch_size: int, start_block: int = 0,
                      prefetch_batches: int = 1) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """Yield (LongTensor [batch_size, seq_len + 1], int64 block indices [batch_size]) for `rank`.

    `data` is what ray.train.get_dataset_shard(name) returns (a DataIterator) or a ray.data.Dataset of
    block rows in index order. start_block must be a multiple of batch_size * world_size (a micro-batch
    boundary). The stream must start at start_block and be contiguous, else this raises (a lost,
    repeated or reordered block is an error, never silently trained on).
    """
    _check_args(rank, world_size, batch_size, start_block)
    group = batch_size * world_size  # blocks per global micro-batch
    expected = start_block  # index of the next block the stream must deliver
    held_idx, held_tok = np.empty(0, np.int64), None  # blocks of the current, incomplete micro-batch
    for batch in data.iter_batches(batch_size=group, batch_format="numpy", prefetch_batches=prefetch_batches):
        keep = batch["index"] >= start_block  # a dataset built without start_block still resumes exactly
        index, tokens = batch["index"][keep], batch["tokens"][keep]
        if len(index) == 0:
            continue
        if not np.array_equal(index, np.arange(expected, expected + len(index))):
            raise RuntimeError(f"block stream out of order on rank {rank}: expected blocks from {expected}, "
                               f"got {index[:8].tolist()}...; is preserve_order set (train_data_config())?")
        expected += len(index)
        held_idx = np.concatenate([held_idx, index])
        held_tok = tokens if held_tok is None else np.concatenate([held_tok, tokens])
        while len(held_idx) >= group:  # a complete global micro-batch: every rank gets batch_size blocks
            mine = held_idx[:group] % world_size == rank
            yield torch.from_numpy(held_tok[:group][mine].astype(np.int64)), held_idx[:group][mine]
            held_idx, held_tok = held_idx[group:], held_tok[group:]


def _check_args(rank: int, world_size: int, batch_size: int, start_block: int) -> None:
    for name, value, low in (("world_size", world_size, 1), ("batch_size", batch_size, 1),
                             ("rank", rank, 0), ("start_block", start_block, 0)):
        if not (isinstance(value, (int, np.integer)) and value >= low):
            raise ValueError(f"iter_rank_batches: {name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"iter_rank_batches: rank {rank} must be < world_size {world_size}")
    if start_block % (batch_size * world_size):
        raise ValueError(f"iter_rank_batches: start_block {start_block} is not a multiple of "
                         f"batch_size * world_size = {batch_size * world_size}")
