"""Cleaning one batch of source rows into the documents to tokenize, counting every drop and change.

In order: split membership by id (rows of the other split are only counted), null text dropped,
quality thresholds (int_score, language_score), invalid UTF-8 replaced (U+FFFD), empty or
whitespace-only text dropped, documents longer than max_doc_chars split into pieces.
Column work is vectorized with pyarrow; Python touches single rows only to repair invalid UTF-8
and to split the rare long document.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.config import DataConfig
from pipeline.data.split import in_split
from pipeline.data.stats import DataStats


def clean_batch(batch: pa.RecordBatch | pa.Table, cfg: DataConfig, split: str, stats: DataStats) -> list[str]:
    """The documents (pieces) of `batch` that belong to `split`, in row order; updates `stats`."""
    table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    text = _as_string(table.column(cfg.text_column))
    ids = _document_ids(table, cfg.id_column, text)
    mine = in_split(ids, split, cfg.val_fraction)
    stats.documents_other_split += int((~mine).sum())
    stats.documents_read += int(mine.sum())
    table = table.set_column(table.schema.get_field_index(cfg.text_column), cfg.text_column, text).filter(mine)

    table = _drop(table, pc.is_null(table.column(cfg.text_column)), "null_text", stats)
    if cfg.min_int_score is not None:
        score = table.column("int_score")
        table = _drop(table, pc.is_null(score), "missing_int_score", stats)
        table = _drop(table, pc.less(table.column("int_score"), cfg.min_int_score), "low_int_score", stats)
    if cfg.min_language_score is not None:
        score = table.column("language_score")
        table = _drop(table, pc.is_null(score), "missing_language_score", stats)
        table = _drop(table, pc.less(table.column("language_score"), cfg.min_language_score),
                      "low_language_score", stats)

    texts = _valid_utf8(table.column(cfg.text_column), stats)
    if not texts:
        return []
    arr = pa.array(texts, pa.large_string())
    empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arr)), 0).to_numpy(zero_copy_only=False)
    if empty.any():
        stats.dropped["empty_text"] += int(empty.sum())
        arr = arr.filter(pa.array(~empty))
        texts = arr.to_pylist()
    stats.documents_kept += len(texts)
    long_rows = np.flatnonzero(pc.greater(pc.utf8_length(arr), cfg.max_doc_chars).to_numpy(zero_copy_only=False))
    if len(long_rows):
        stats.altered["split_long"] += len(long_rows)
        texts = _split_long(texts, set(long_rows.tolist()), cfg.max_doc_chars)
    stats.pieces += len(texts)
    return texts


def _as_string(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_binary(column.type):
        return pa.chunked_array([c.view(pa.string()) for c in column.chunks], pa.string())
    if pa.types.is_large_binary(column.type):
        return pa.chunked_array([c.view(pa.large_string()) for c in column.chunks], pa.large_string())
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"text column has type {column.type}, expected string or binary")
    return column


def _document_ids(table: pa.Table, id_column: str, text: pa.ChunkedArray) -> list[str]:
    """Document ids; a missing id falls back to a hash of the text (stable, so the split still is)."""
    if id_column not in table.column_names:
        ids = [None] * table.num_rows
    else:
        ids = table.column(id_column).cast(pa.string()).to_pylist()
    if any(i is None for i in ids):
        raw = pa.chunked_array([c.view(pa.binary()) if pa.types.is_string(c.type) else c.view(pa.large_binary())
                                for c in text.chunks]).to_pylist()
        ids = [i if i is not None else "sha256:" + hashlib.sha256(r or b"").hexdigest() for i, r in zip(ids, raw)]
    return ids


def _drop(table: pa.Table, mask, reason: str, stats: DataStats) -> pa.Table:
    mask = pc.fill_null(mask, False)
    n = pc.sum(mask).as_py() or 0
    if n:
        stats.dropped[reason] += n
        table = table.filter(pc.invert(mask))
    return table


def _valid_utf8(column: pa.ChunkedArray, stats: DataStats) -> list[str]:
    """The column as Python strings; rows with invalid UTF-8 are decoded with U+FFFD and counted."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    try:
        column.validate(full=True)
        return column.to_pylist()
    except pa.ArrowInvalid:
        pass
    binary_type = pa.binary() if pa.types.is_string(column.type) else pa.large_binary()
    out = []
    for raw in column.view(binary_type).to_pylist():
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            stats.altered["invalid_utf8"] += 1
            out.append(raw.decode("utf-8", errors="replace"))
    return out


def _split_long(texts: list[str], long_rows: set[int], max_chars: int) -> list[str]:
    out = []
    for i, text in enumerate(texts):
        out.extend(split_text(text, max_chars) if i in long_rows else (text,))
    return out


def split_text(text: str, max_chars: int) -> list[str]:
    """Pieces of at most max_chars, cut after the last whitespace in the second half of each window."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = max(text.rfind(" ", start + max_chars // 2, end), text.rfind("\n", start + max_chars // 2, end))
        end = cut + 1 if cut > start else end
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces
