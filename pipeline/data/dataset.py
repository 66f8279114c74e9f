"""The block datasets: one per training rank, each reading only that rank's share of the input.

Streaming from text, rank r of W (its share: pipeline/data/shards.py):

    its (file, row group) fragments, in order --map_batches(tokenize_pieces, tasks)--> token chunks
                                             --map_batches(PackBlocks, one actor)--> {"index", "tokens"} blocks

Tokenizing runs in parallel tasks (one per fragment, each calling the fast tokenizer's batched encode, single-
threaded; each chunk leaves its task as soon as it is made); packing is sequential by nature (a block's index
depends on every token before it), so it runs in a single actor per rank that receives the chunks in stream
order: the dataset's execution preserves order. `index` is the block's position in its rank's stream (rank-
local); with W = 1 (jobs/prepare_data.py) the one share is the whole input and the index is split-wide.
A chunk carries the counts of its rows (DataStats) so the packer can record the totals of its rank.
Prepared data: rank r reads only the row groups of its share of the prepared shards (pipeline/data/prepared.py).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pyarrow as pa
import ray

from pipeline.data.cleaning import clean_batch
from pipeline.data.config import EMBEDDED, DataConfig
from pipeline.data.packing import BlockPacker, block_dtype
from pipeline.data.shards import Shares, prepared_shares, source_shares
from pipeline.data.source import read_file_batches
from pipeline.data.split import check_split
from pipeline.data.stats import DataStats, StatsRecorder
from pipeline.data.tokenizer import ensure_embedded_tokenizer, load_tokenizer

CHUNK_FLUSH_BYTES = 1 << 20  # Ray Data block target below one chunk's size: each chunk is its own block


def block_dataset(cfg: DataConfig, split: str, *, rank: int = 0, world_size: int = 1, start_block: int = 0,
                  stats: StatsRecorder | None = None) -> ray.data.Dataset:
    """Rows {"index": int64, "tokens": [seq_len + 1]} of rank's share of `split`, in index order, from start_block
    (a rank-local index) on: one pass (epoch) over the share. world_size=1: the whole split, indexed split-wide.

    Streams from cfg.source, or reads prepared shards when cfg.packed_dir is set. With `stats`, the counts of
    the stream (DataStats) are recorded as it runs, as part `rank` (prepared data: the manifest's counts).
    """
    return block_datasets(cfg, split, world_size=world_size, ranks=[rank], start_block=start_block, stats=stats)[0]


def block_datasets(cfg: DataConfig, split: str, *, world_size: int, ranks: list[int] | None = None,
                   start_block: int = 0, stats: StatsRecorder | None = None,
                   shares: Shares | None = None) -> list[ray.data.Dataset]:
    """block_dataset for each of `ranks` (default: all world_size of them), listing and dealing the input once
    (or using `shares`, from pipeline.data.shards.input_shares)."""
    check_split(split)
    if not (isinstance(start_block, int) and start_block >= 0):
        raise ValueError(f"start_block: must be an int >= 0, got {start_block!r}")
    ranks = list(range(world_size)) if ranks is None else ranks
    for r in ranks:
        if not (isinstance(r, int) and 0 <= r < world_size):
            raise ValueError(f"rank: must be an int in [0, world_size={world_size}), got {r!r}")
    if cfg.packed_dir is not None:
        from pipeline.data.prepared import prepared_stats, read_prepared_blocks
        shares = _checked(shares or prepared_shares(cfg, split, world_size), "prepared", split, world_size)
        if stats is not None:
            stats.record("manifest", prepared_stats(cfg, split), part="manifest")
        return [read_prepared_blocks(cfg, shares.ranks[r], start_block=start_block) for r in ranks]
    cfg = resolved_config(cfg)
    shares = _checked(shares or source_shares(cfg, world_size), "source", None, world_size)
    return [_stream_blocks(cfg, split, shares, r, start_block, stats) for r in ranks]


def _checked(shares: Shares, kind: str, split: str | None, world_size: int) -> Shares:
    if (shares.kind, shares.split, shares.world_size) != (kind, split, world_size):
        raise ValueError(f"shares: {shares.kind} input ({shares.split or 'both splits'}) dealt to "
                         f"{shares.world_size} ranks, expected {kind} input ({split or 'both splits'}) for {world_size}")
    return shares


def resolved_config(cfg: DataConfig) -> DataConfig:
    """cfg with local paths made absolute and the embedded tokenizer built and named by its file,
    so Ray workers (other processes, maybe another directory) load exactly the same things."""
    tokenizer = cfg.tokenizer
    if tokenizer == EMBEDDED:
        tokenizer = str(ensure_embedded_tokenizer(cfg))
    elif tokenizer.endswith(".json"):
        tokenizer = cfg.resolve_path(tokenizer)
    return cfg.replace(tokenizer=tokenizer, output_dir=cfg.resolve_path(cfg.output_dir))


def _stream_blocks(cfg: DataConfig, split: str, shares: Shares, rank: int, start_block: int,
                  stats: StatsRecorder | None) -> ray.data.Dataset:
    tokenizer = load_tokenizer(cfg)  # fail here, in the caller, if it cannot load
    pieces = shares.ranks[rank]
    items = ray.data.from_items([{"path": p.path, "row_group": p.row_group} for p in pieces],
                                override_num_blocks=len(pieces))
    # Every chunk leaves its tokenize task as soon as it is made (Ray Data would otherwise gather a task's
    # output into blocks of up to 128 MiB, i.e. a whole fragment, and nothing downstream could overlap with it).
    items.context.target_max_block_size = CHUNK_FLUSH_BYTES
    chunks = items.map_batches(
        tokenize_pieces, batch_size=1, batch_format="pyarrow", num_cpus=0.25,
        # One single-threaded tokenizing task per core. Measured (bench/data.py): 8 concurrent tasks (0.25 CPU
        # each, 2 cores), each with the tokenizer's own thread pool, ran at half the speed: the tasks and
        # their threads oversubscribe the cores, and the head fragment, which the ordered packer waits for, gets
        # a small share of them. Fractional num_cpus still lets Ray Train workers hold whole CPUs. No more tasks
        # than the rank has fragments: one task a fragment is all the stage can run (Ray Data warns otherwise).
        compute=ray.data.TaskPoolStrategy(size=min(len(pieces), tokenize_concurrency(cfg, shares.world_size))),
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},  # thread count only: same tokens
        fn_kwargs={"fs": shares.fs, "cfg": cfg, "split": split})
    blocks = chunks.map_batches(
        # One packer, one call at a time: with several concurrent calls per actor (Ray Data batches inputs in
        # threads) the calls can run out of submission order, and block indices would not follow the stream.
        PackBlocks, batch_size=None, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=1), num_cpus=0.1,
        fn_constructor_kwargs={"block_len": cfg.block_len, "dtype": block_dtype(tokenizer.vocab_size),
                               "start_block": start_block, "stats": stats, "part": rank},
        # A restarted packer would have lost its tail and block count: fail loudly instead of restarting.
        # (These three go through map_batches' **ray_remote_args, which Ray 2.60 marks deprecated for 2.64 with a
        # RayDeprecationWarning; it has no named parameter for them yet, and its own actor pool reads them there.)
        max_restarts=0, max_task_retries=0,
        # Ray Data creates its actors with allow_out_of_order_execution=True: a call whose chunk is not yet
        # local would let a later chunk be packed first (its output is still reordered by input, so the blocks
        # come out scrambled and misnumbered; seen in 3 of 25 runs). The packer must take chunks in order.
        allow_out_of_order_execution=False)
    blocks.context.execution_options.preserve_order = True  # chunks reach the packer in stream order
    return blocks


def tokenize_concurrency(cfg: DataConfig, world_size: int = 1) -> int:
    """cfg.tokenize_tasks, else the cluster's CPU count when the dataset is built, shared by the world_size
    rank pipelines that stream at the same time."""
    if cfg.tokenize_tasks is not None:
        return cfg.tokenize_tasks
    return max(1, int(ray.cluster_resources().get("CPU", 1)) // world_size)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(cfg: DataConfig):
    return load_tokenizer(cfg)  # once per worker process, not once per file


def tokenize_pieces(items: pa.Table, fs, cfg: DataConfig, split: str):
    """For each (file, row group) fragment: one chunk row per read batch: its token stream (EOS after each
    document) and counts (the fragment counted once, with its first chunk)."""
    tokenizer = _cached_tokenizer(cfg)
    for path, row_group in zip(items.column("path").to_pylist(), items.column("row_group").to_pylist()):
        first = True
        for batch in read_file_batches(fs, path, cfg, row_group=row_group):
            stats = DataStats(fragments_read=int(first))
            first = False
            texts = clean_batch(batch, cfg, split, stats)
            stream, lengths = tokenizer.encode_docs(texts) if texts else (np.empty(0, np.int64), np.empty(0))
            stats.document_tokens, stats.eos_tokens = int(lengths.sum()), len(texts)
            yield pa.table({
                "tokens": pa.array([stream.astype(np.int32)], pa.large_list(pa.int32())),
                "stats": [json.dumps(stats.to_json())],
            })


class PackBlocks:
    """A rank's single packing actor: chunks in stream order -> full blocks with their index in the rank's stream."""

    def __init__(self, block_len: int, dtype, start_block: int, stats: StatsRecorder | None, part: int = 0):
        self.packer = BlockPacker(block_len, dtype)
        self.start_block = start_block
        self.stats, self.recorder, self.part = DataStats(), stats, part
        self.execution = StatsRecorder.new_execution_id()

    def __call__(self, chunks: pa.Table) -> dict[str, np.ndarray]:
        tokens = chunks.column("tokens").combine_chunks()
        stream = tokens.flatten().to_numpy() if len(tokens) else np.empty(0, np.int32)
        indices, blocks = self.packer.push(stream)
        for s in chunks.column("stats").to_pylist():
            self.stats.add(DataStats.from_json(json.loads(s)))
        self.stats.blocks = self.packer.next_index
        self.stats.partial_block_tokens = self.packer.tail_tokens
        if self.recorder is not None:
            self.recorder.record(self.execution, self.stats, part=self.part)
        keep = indices >= self.start_block  # a dataset built from a resume position: earlier blocks were trained on
        return {"index": indices[keep], "tokens": blocks[keep]}
