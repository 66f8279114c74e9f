"""Prepared data: packed blocks written once as Parquet shards plus a manifest, read by training.

    <dir>/manifest.json          tokenizer (name, sha256, vocab, eos), seq_len, dtype, per split: blocks,
                                 tokens, shards [{path, first_index, blocks}], the DataStats counts
    <dir>/tokenizer.json         a copy, when the tokenizer is a file
    <dir>/<split>/shard-00000.parquet   columns index (int64), tokens (fixed_size_list<uint16|int32>), in row
                                        groups of data.row_group_blocks blocks: the unit dealt to training ranks

The folder appears atomically (written aside, then renamed), so a half-written one is never read. Training rank r
reads only the row groups of its share (pipeline/data/shards.py); its blocks are indexed by their position in
that share.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
from tqdm import tqdm

from pipeline.data.config import EMBEDDED, DataConfig
from pipeline.data.packing import block_dtype
from pipeline.data.split import SPLITS
from pipeline.data.stats import DataStats, StatsRecorder
from pipeline.data.tokenizer import copy_tokenizer, load_tokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


# DataConfig fields that change which blocks are made, beyond those the folder name spells out (source name,
# tokenizer, seq_len, val_fraction, shuffle_seed): when any differs from its default, a hash of them is appended,
# so that prepared data of another selection (e.g. max_files=1) is never reused in its place.
_CONTENT_FIELDS = ("eos_token", "min_int_score", "min_language_score", "max_doc_chars", "max_files",
                   "text_column", "id_column")


def default_packed_dir(cfg: DataConfig) -> Path:
    """outputs/packed/<source>-<tokenizer hash>-L<seq_len>-v<val_fraction>-s<seed>[-d<hash of the rest>]."""
    import dataclasses
    import hashlib

    source = cfg.source.rstrip("/").split("/")[-1].replace(".parquet", "") or "source"
    if cfg.source == EMBEDDED and cfg.embedded_scope != "stdlib":
        source = f"{source}-{cfg.embedded_scope}"
    sha = load_tokenizer(cfg).sha256[:10]
    name = f"{source}-{sha}-L{cfg.seq_len}-v{cfg.val_fraction:g}-s{cfg.shuffle_seed}"
    defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    rest = {k: getattr(cfg, k) for k in _CONTENT_FIELDS if getattr(cfg, k) != defaults[k]}
    if cfg.source != EMBEDDED:
        rest["source"] = cfg.source  # two sources with the same last path component are not the same data
    if rest:
        name += "-d" + hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:8]
    return Path(cfg.output_dir).resolve() / "packed" / name


def prepare_blocks(cfg: DataConfig, out_dir: Path, *, progress: bool = True) -> dict:
    """Stream both splits of cfg (its source, not its packed_dir) into shards under out_dir."""
    from pipeline.data.dataset import block_dataset, resolved_config

    out_dir = Path(out_dir).resolve()
    if (out_dir / MANIFEST).exists():
        raise ValueError(f"prepared data already exists at {out_dir}; delete it or choose another folder")
    cfg = resolved_config(cfg.replace(packed_dir=None))
    tokenizer = load_tokenizer(cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        manifest = {
            "format": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "data_config": cfg.to_dict(), "seq_len": cfg.seq_len, "block_len": cfg.block_len,
            "dtype": block_dtype(tokenizer.vocab_size).name,
            "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256,
                          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
            "splits": {},
        }
        for split in SPLITS:
            recorder = StatsRecorder()
            ds = block_dataset(cfg, split, stats=recorder)
            shards = _write_split(ds, tmp / split, cfg, split, progress)
            stats = recorder.snapshot() or DataStats()
            blocks = sum(s["blocks"] for s in shards)
            if blocks != stats.blocks:
                raise RuntimeError(f"{split}: wrote {blocks} blocks but the packer made {stats.blocks}")
            manifest["splits"][split] = {"blocks": blocks, "tokens": blocks * cfg.block_len,
                                         "shards": shards, "stats": stats.to_json()}
        copy_tokenizer(tokenizer, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        tmp.chmod(0o755)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write_split(ds: ray.data.Dataset, folder: Path, cfg: DataConfig, split: str, progress: bool) -> list[dict]:
    folder.mkdir(parents=True)
    shards, expected = [], 0
    bar = tqdm(desc=f"prepare {split}", unit=" blocks", disable=not progress)
    for batch in ds.iter_batches(batch_size=cfg.shard_blocks, batch_format="numpy"):
        index, tokens = batch["index"], batch["tokens"]
        if not np.array_equal(index, np.arange(expected, expected + len(index))):
            raise RuntimeError(f"{split}: block stream out of order at block {expected}")
        expected += len(index)
        name = f"{split}/shard-{len(shards):05d}.parquet"
        flat = pa.array(np.ascontiguousarray(tokens).reshape(-1))
        table = pa.table({"index": pa.array(index, pa.int64()),
                          "tokens": pa.FixedSizeListArray.from_arrays(flat, cfg.block_len)})
        pq.write_table(table, folder.parent / name, row_group_size=cfg.row_group_blocks)
        shards.append({"path": name, "first_index": int(index[0]), "blocks": len(index)})
        bar.update(len(index))
    bar.close()
    return shards


def read_manifest(packed_dir: str | Path) -> dict:
    path = Path(packed_dir) / MANIFEST
    if not path.is_file():
        raise ValueError(f"DataConfig.packed_dir: no {MANIFEST} in {str(packed_dir)!r}; run jobs/prepare_data.py")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"DataConfig.packed_dir: {path} has format {manifest.get('format')}, expected {FORMAT_VERSION}")
    return manifest


def check_manifest(cfg: DataConfig, manifest: dict) -> None:
    """Refuse prepared data made with another seq_len or tokenizer than cfg's."""
    if manifest["seq_len"] != cfg.seq_len:
        raise ValueError(f"DataConfig.seq_len: {cfg.seq_len}, but {cfg.packed_dir} was prepared with "
                         f"seq_len {manifest['seq_len']}")
    sha = load_tokenizer(cfg).sha256
    if manifest["tokenizer"]["sha256"] != sha:
        raise ValueError(f"DataConfig.tokenizer: {cfg.tokenizer!r} (sha256 {sha[:12]}) is not the tokenizer "
                         f"{cfg.packed_dir} was prepared with ({manifest['tokenizer']['name']}, "
                         f"sha256 {manifest['tokenizer']['sha256'][:12]})")


def prepared_stats(cfg: DataConfig, split: str) -> DataStats:
    return DataStats.from_json(read_manifest(cfg.resolve_path(cfg.packed_dir))["splits"][split]["stats"])


def read_prepared_blocks(cfg: DataConfig, pieces, *, start_block: int = 0) -> ray.data.Dataset:
    """One rank's share (a sequence of pipeline.data.shards.Piece, row groups in block order) as rows {"index":
    position in the share, "tokens"}, from start_block on. Row groups wholly before start_block are never opened."""
    items, local = [], 0
    for piece in pieces:
        if local + piece.rows > start_block:
            items.append({"path": piece.path, "row_group": piece.row_group, "first_index": piece.first_index,
                          "local_first": local})
        local += piece.rows
    if not items:  # nothing left to read: one empty item keeps the dataset's schema-free shape valid
        items = [{"path": None, "row_group": -1, "first_index": -1, "local_first": -1}]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(read_pieces, batch_size=1, batch_format="pyarrow", num_cpus=0.25,
                        compute=ray.data.TaskPoolStrategy(size=min(len(items), cfg.read_tasks)),
                        fn_kwargs={"start_block": start_block, "block_len": cfg.block_len})
    ds.context.execution_options.preserve_order = True
    return ds


def read_pieces(items: pa.Table, start_block: int, block_len: int):
    """For each item (a row group of a shard): its blocks, indexed from local_first, those from start_block on.
    The stored split-wide indices must be the ones the manifest places there (else the data is not what it says)."""
    for path, row_group, first_index, local_first in zip(*(items.column(c).to_pylist() for c in
                                                           ("path", "row_group", "first_index", "local_first"))):
        if path is None:
            continue
        table = pq.ParquetFile(path).read_row_group(row_group, columns=["index", "tokens"])
        stored = table.column("index").to_numpy()
        if not np.array_equal(stored, np.arange(first_index, first_index + len(stored))):
            raise RuntimeError(f"prepared shard {path} row group {row_group}: holds blocks {stored[:4].tolist()}..., "
                               f"the manifest places blocks {first_index}.. there")
        tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(-1, block_len)
        index = np.arange(local_first, local_first + len(stored), dtype=np.int64)
        keep = index >= start_block
        if keep.any():
            yield {"index": index[keep], "tokens": tokens[keep]}
