"""Finding and reading the source Parquet files: local paths, hf:// (huggingface_hub.HfFileSystem),
or any fsspec URI (s3://, gs://, ...), in a seeded file order, reading only the needed columns.
"""

from __future__ import annotations

from typing import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from pipeline.data.config import EMBEDDED, DataConfig


def hub_filesystem() -> fsspec.AbstractFileSystem:
    """The Hugging Face Hub as a filesystem (paths like datasets/HuggingFaceFW/fineweb-edu/sample/10BT)."""
    from huggingface_hub import HfFileSystem
    return HfFileSystem()


def source_filesystem(cfg: DataConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path within it) for cfg.source; the embedded corpus is built on first use."""
    if cfg.source == EMBEDDED:
        from pipeline.data.corpus import ensure_corpus
        return LocalFileSystem(), str(ensure_corpus(cfg.output_dir, cfg.embedded_scope))
    if cfg.source.startswith("hf://"):
        return hub_filesystem(), cfg.source[len("hf://"):].rstrip("/")
    if "://" in cfg.source and not cfg.source.startswith("file://"):
        try:
            return fsspec.core.url_to_fs(cfg.source)
        except ImportError as e:  # s3fs, gcsfs, adlfs, ...: fsspec's backends are separate packages
            raise ValueError(f"DataConfig.source: reading {cfg.source!r} needs a filesystem package that is not "
                             f"installed: {e}") from e
    return LocalFileSystem(), cfg.resolve_path(cfg.source.removeprefix("file://"))


def list_source_files(cfg: DataConfig) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The Parquet files of cfg.source in the seeded order (then the first cfg.max_files)."""
    fs, root = source_filesystem(cfg)
    if not fs.exists(root):
        raise ValueError(f"DataConfig.source: {cfg.source!r} does not exist")
    if fs.isdir(root):
        files = sorted(p for p in fs.find(root) if p.endswith(".parquet"))
        if not files:
            raise ValueError(f"DataConfig.source: no .parquet files under {cfg.source!r}")
    else:
        files = [root]
    # Seeded shuffle of the sorted list: the same seed and files give the same order everywhere.
    order = np.random.default_rng(cfg.shuffle_seed).permutation(len(files))
    files = [files[i] for i in order]
    return fs, files[: cfg.max_files] if cfg.max_files else files


def needed_columns(cfg: DataConfig) -> list[str]:
    cols = [cfg.text_column, cfg.id_column]
    if cfg.min_int_score is not None:
        cols.append("int_score")
    if cfg.min_language_score is not None:
        cols.append("language_score")
    return cols


def check_columns(pf: pq.ParquetFile, path: str, cfg: DataConfig) -> list[str]:
    """The needed columns this file has; an error naming the file when it lacks a required one."""
    present = set(pf.schema_arrow.names)
    required = [c for c in needed_columns(cfg) if c != cfg.id_column]
    missing = [c for c in required if c not in present]
    if missing:
        raise ValueError(f"source file {path!r} has no column(s) {missing} (it has {sorted(present)}); "
                         f"set data.text_column or drop the score thresholds that need them")
    return [c for c in needed_columns(cfg) if c in present]


def read_file_batches(fs: fsspec.AbstractFileSystem, path: str, cfg: DataConfig,
                      row_group: int | None = None) -> Iterator[pa.RecordBatch]:
    """Record batches of the needed columns of one Parquet file (or only of one of its row groups), in row order."""
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        columns = check_columns(pf, path, cfg)
        row_groups = None if row_group is None else [row_group]
        yield from pf.iter_batches(batch_size=cfg.read_batch_rows, columns=columns, row_groups=row_groups)


def sample_texts(cfg: DataConfig, n: int) -> Iterator[str]:
    """The first n non-empty training texts in file order (for tokenizer training)."""
    from pipeline.data.cleaning import clean_batch
    from pipeline.data.stats import DataStats

    fs, files = list_source_files(cfg)
    seen = 0
    for path in files:
        for batch in read_file_batches(fs, path, cfg):
            for text in clean_batch(batch, cfg, "train", DataStats()):
                yield text
                seen += 1
                if seen >= n:
                    return
