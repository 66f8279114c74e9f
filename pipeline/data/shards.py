"""Dealing the input to the training ranks: disjoint, deterministic, near-equal shares of Parquet row groups.

A piece is one Parquet row group: of a source file when streaming from text (a (file, row group) fragment, so a
corpus with fewer files than ranks still splits), of a prepared shard when reading prepared blocks. The pieces
are listed in a fixed order (streaming: the seeded file order, row groups in file order; prepared: shard order,
which is block order) and dealt greedily: each piece in turn goes to the rank whose share is smallest so far (by
uncompressed text bytes when streaming, by blocks when prepared; a tie goes to the lowest rank). A share keeps
its pieces in list order. So the same input and the same world size give the same shares on any machine, every
piece is in exactly one share, and two shares differ by at most one piece's size.

Each rank's pipeline reads (and, when streaming, cleans, tokenizes and packs) only the pieces of its share
(pipeline/data/dataset.py); a rank never opens another rank's pieces.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import pyarrow.parquet as pq

from pipeline.data.config import DataConfig

FOOTER_READ_THREADS = 16  # parallel footer reads when listing a remote source (hf://, s3://): latency-bound


@dataclass(frozen=True)
class Piece:
    path: str
    row_group: int
    rows: int
    size: int  # what dealing balances: uncompressed text bytes (source) or blocks (prepared)
    first_index: int = -1  # prepared: the split-wide index of its first block (checked when read)


@dataclass(frozen=True)
class Shares:
    """The pieces of one input dealt to world_size ranks. kind: "source" (text; split None: it serves both, the
    split being by document id inside each fragment) or "prepared" (the pieces of one split)."""

    kind: str
    split: str | None
    world_size: int
    pieces: tuple[Piece, ...]
    ranks: tuple[tuple[Piece, ...], ...]
    fs: Any = None  # the source filesystem (streaming)

    def sizes(self) -> list[int]:
        return [sum(p.size for p in share) for share in self.ranks]


def deal(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Piece positions per rank: each piece, in order, to the rank with the smallest total so far (ties: lowest)."""
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size: must be an int >= 1, got {world_size!r}")
    totals = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"piece {i}: negative size {size}")
        r = min(range(world_size), key=lambda k: (totals[k], k))
        shares[r].append(i)
        totals[r] += size
    return shares


def make_shares(kind: str, split: str | None, pieces: list[Piece], world_size: int, what: str,
                fs: Any = None) -> Shares:
    """Deal pieces; refuse when a rank would get nothing to read (`what` names the input in the error)."""
    dealt = deal([p.size for p in pieces], world_size)
    empty = [r for r, share in enumerate(dealt) if not share]
    if empty:
        raise ValueError(f"{what}: {len(pieces)} piece(s) (Parquet row groups) for {world_size} training workers; "
                         f"each worker reads only its own pieces, so every worker needs at least one (ranks {empty} "
                         f"would get none). Add data, write it with smaller row groups, or lower train.num_workers")
    return Shares(kind=kind, split=split, world_size=world_size, pieces=tuple(pieces),
                  ranks=tuple(tuple(pieces[i] for i in share) for share in dealt), fs=fs)


# --- source text -------------------------------------------------------------------------------------------------

def source_pieces(cfg: DataConfig):
    """(filesystem, the (file, row group) fragments of cfg.source in the seeded file order). Reads every file's
    footer (in parallel threads for remote sources); a file without the needed columns is an error naming it."""
    from pipeline.data.source import list_source_files

    fs, files = list_source_files(cfg)
    threads = max(1, min(FOOTER_READ_THREADS, len(files)))
    with ThreadPoolExecutor(threads) as pool:  # map keeps the file order: the result does not depend on timing
        per_file = list(pool.map(lambda path: _row_groups(fs, path, cfg), files))
    pieces = [piece for file_pieces in per_file for piece in file_pieces]
    if not pieces:
        raise ValueError(f"DataConfig.source: the Parquet files of {cfg.source!r} hold no rows")
    return fs, pieces


def _row_groups(fs, path: str, cfg: DataConfig) -> list[Piece]:
    from pipeline.data.source import check_columns

    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        check_columns(pf, path, cfg)
        meta = pf.metadata
        text_col = [meta.schema.column(i).path for i in range(meta.num_columns)].index(cfg.text_column)
        return [Piece(path, rg, meta.row_group(rg).num_rows, meta.row_group(rg).column(text_col).total_uncompressed_size)
                for rg in range(meta.num_row_groups) if meta.row_group(rg).num_rows > 0]


def source_shares(cfg: DataConfig, world_size: int) -> Shares:
    """The source's fragments dealt to world_size ranks (the same shares serve both splits: the split is by
    document id, inside each fragment)."""
    fs, pieces = source_pieces(cfg)
    return make_shares("source", None, pieces, world_size, f"DataConfig.source {cfg.source!r}", fs=fs)


# --- prepared blocks ---------------------------------------------------------------------------------------------

def prepared_pieces(cfg: DataConfig, split: str) -> list[Piece]:
    """The row groups of split's prepared shards, in block order, checked against the manifest."""
    from pipeline.data.prepared import check_manifest, read_manifest

    packed_dir = cfg.resolve_path(cfg.packed_dir)
    manifest = read_manifest(packed_dir)
    check_manifest(cfg, manifest)
    pieces, next_index = [], 0
    for shard in manifest["splits"][split]["shards"]:
        path = os.path.join(packed_dir, shard["path"])
        if shard["first_index"] != next_index:
            raise ValueError(f"prepared data {packed_dir}: {shard['path']} starts at block {shard['first_index']}, "
                             f"expected {next_index} (the manifest's shards must be contiguous)")
        meta = pq.ParquetFile(path).metadata
        rows = [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]
        if sum(rows) != shard["blocks"]:
            raise ValueError(f"prepared data {packed_dir}: {shard['path']} holds {sum(rows)} blocks, the manifest "
                             f"says {shard['blocks']}")
        for rg, n in enumerate(rows):
            if n:
                pieces.append(Piece(path, rg, n, n, first_index=next_index))
            next_index += n
    if not pieces:
        raise ValueError(f"DataConfig.packed_dir: the {split} split of {packed_dir} holds no blocks")
    return pieces


def prepared_shares(cfg: DataConfig, split: str, world_size: int) -> Shares:
    return make_shares("prepared", split, prepared_pieces(cfg, split), world_size,
                       f"DataConfig.packed_dir {cfg.packed_dir!r} ({split} split)")


def input_shares(cfg: DataConfig, world_size: int) -> dict[str, Shares]:
    """Per split, its input dealt to world_size ranks (streaming: one listing of the source for both splits)."""
    from pipeline.data.split import SPLITS

    if cfg.packed_dir is not None:
        return {split: prepared_shares(cfg, split, world_size) for split in SPLITS}
    shares = source_shares(cfg, world_size)
    return {split: shares for split in SPLITS}
