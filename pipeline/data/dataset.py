"""The streaming block dataset: Parquet text -> cleaned documents -> tokens -> packed blocks, in Ray Data.

    files (seeded order) --map_batches(tokenize_files, tasks)--> token chunks (one per read batch)
                         --map_batches(PackBlocks, one actor)--> {"index", "tokens"} blocks

Tokenizing runs in parallel tasks (one per file, each calling the fast tokenizer's batched encode, one
task per core, single-threaded; each chunk leaves its task as soon as it is made);
packing is sequential by nature (a block's index depends on every token before it), so it runs in a
single actor that receives the chunks in stream order: the dataset's execution preserves order.
A chunk carries the counts of its rows (DataStats) so the packer can record the totals.
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
from pipeline.data.source import list_source_files, read_file_batches
from pipeline.data.split import check_split
from pipeline.data.stats import DataStats, StatsRecorder
from pipeline.data.tokenizer import ensure_embedded_tokenizer, load_tokenizer

CHUNK_FLUSH_BYTES = 1 << 20  # Ray Data block target below one chunk's size: each chunk is its own block


def block_dataset(cfg: DataConfig, split: str, *, start_block: int = 0,
                  stats: StatsRecorder | None = None) -> ray.data.Dataset:
    """Rows {"index": int64, "tokens": [seq_len + 1]} of `split` in index order, from start_block on.

    Streams from cfg.source, or reads prepared shards when cfg.packed_dir is set. With `stats`, the
    counts of the stream (DataStats) are recorded as it runs (prepared data: the manifest's counts).
    """
    check_split(split)
    if not (isinstance(start_block, int) and start_block >= 0):
        raise ValueError(f"start_block: must be an int >= 0, got {start_block!r}")
    if cfg.packed_dir is not None:
        from pipeline.data.prepared import read_prepared_blocks
        return read_prepared_blocks(cfg, split, start_block=start_block, stats=stats)
    return _stream_blocks(resolved_config(cfg), split, start_block, stats)


def resolved_config(cfg: DataConfig) -> DataConfig:
    """cfg with local paths made absolute and the embedded tokenizer built and named by its file,
    so Ray workers (other processes, maybe another directory) load exactly the same things."""
    tokenizer = cfg.tokenizer
    if tokenizer == EMBEDDED:
        tokenizer = str(ensure_embedded_tokenizer(cfg))
    elif tokenizer.endswith(".json"):
        tokenizer = cfg.resolve_path(tokenizer)
    return cfg.replace(tokenizer=tokenizer, output_dir=cfg.resolve_path(cfg.output_dir))


def _stream_blocks(cfg: DataConfig, split: str, start_block: int, stats: StatsRecorder | None) -> ray.data.Dataset:
    tokenizer = load_tokenizer(cfg)  # fail here, in the caller, if it cannot load
    fs, files = list_source_files(cfg)
    items = ray.data.from_items([{"path": p} for p in files], override_num_blocks=len(files))
    # Every chunk leaves its tokenize task as soon as it is made (Ray Data would otherwise gather a task's
    # output into blocks of up to 128 MiB, i.e. a whole file, and nothing downstream could overlap with it).
    items.context.target_max_block_size = CHUNK_FLUSH_BYTES
    chunks = items.map_batches(
        tokenize_files, batch_size=1, batch_format="pyarrow", num_cpus=0.25,
        # One single-threaded tokenizing task per core. Measured (bench/data.py): 8 concurrent tasks (0.25 CPU
        # each, 2 cores), each with the tokenizer's own thread pool, ran at half the speed: the tasks and
        # their threads oversubscribe the cores, and the head file, which the ordered packer waits for, gets
        # a small share of them. Fractional num_cpus still lets Ray Train workers hold whole CPUs.
        concurrency=tokenize_concurrency(cfg),
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},  # thread count only: same tokens
        fn_kwargs={"fs": fs, "cfg": cfg, "split": split})
    blocks = chunks.map_batches(
        # One packer, one call at a time: with several concurrent calls per actor (Ray Data batches inputs in
        # threads) the calls can run out of submission order, and block indices would not follow the stream.
        PackBlocks, batch_size=None, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=1), num_cpus=0.1,
        fn_constructor_kwargs={"block_len": cfg.block_len, "dtype": block_dtype(tokenizer.vocab_size),
                               "start_block": start_block, "stats": stats},
        # A restarted packer would have lost its tail and block count: fail loudly instead of restarting.
        max_restarts=0, max_task_retries=0,
        # Ray Data creates its actors with allow_out_of_order_execution=True: a call whose chunk is not yet
        # local would let a later chunk be packed first (its output is still reordered by input, so the blocks
        # come out scrambled and misnumbered; seen in 3 of 25 runs). The packer must take chunks in order.
        allow_out_of_order_execution=False)
    blocks.context.execution_options.preserve_order = True  # chunks reach the packer in stream order
    return blocks


def tokenize_concurrency(cfg: DataConfig) -> int:
    """cfg.tokenize_tasks, else the cluster's CPU count when the dataset is built."""
    if cfg.tokenize_tasks is not None:
        return cfg.tokenize_tasks
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(cfg: DataConfig):
    return load_tokenizer(cfg)  # once per worker process, not once per file


def tokenize_files(items: pa.Table, fs, cfg: DataConfig, split: str):
    """For each file: one chunk row per read batch: its token stream (EOS after each document) and counts."""
    tokenizer = _cached_tokenizer(cfg)
    for path in items.column("path").to_pylist():
        for batch in read_file_batches(fs, path, cfg):
            stats = DataStats()
            texts = clean_batch(batch, cfg, split, stats)
            stream, lengths = tokenizer.encode_docs(texts) if texts else (np.empty(0, np.int64), np.empty(0))
            stats.document_tokens, stats.eos_tokens = int(lengths.sum()), len(texts)
            yield pa.table({
                "tokens": pa.array([stream.astype(np.int32)], pa.large_list(pa.int32())),
                "stats": [json.dumps(stats.to_json())],
            })


class PackBlocks:
    """The single packing actor: chunks in stream order -> full blocks with their global index."""

    def __init__(self, block_len: int, dtype, start_block: int, stats: StatsRecorder | None):
        self.packer = BlockPacker(block_len, dtype)
        self.start_block = start_block
        self.stats, self.recorder = DataStats(), stats
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
            self.recorder.record(self.execution, self.stats)
        keep = indices >= self.start_block  # resume: blocks before start_block were trained on
        return {"index": indices[keep], "tokens": blocks[keep]}
