"""Shared helpers for the data tests (no tests here): FineWeb-Edu-schema Parquet files and a small BPE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("the of and to in is that for it as with was on be by this are from or an which at not have "
         "attention sparse block token query key value model training data window select compress "
         "learning gradient layer network python function module class returns value error").split()

SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
    ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
    ("int_score", pa.int64()),
])


def sentence_text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, size=n_words)
    return " ".join(words) + "."


def fineweb_rows(prefix: str, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        score = float(rng.uniform(1, 5))
        rows.append({"text": sentence_text(rng, int(rng.integers(5, 120))), "id": f"<urn:{prefix}-{i}>",
                     "dump": "CC-TEST", "url": f"https://example.org/{prefix}/{i}", "date": "2024-01-01",
                     "file_path": f"s3://test/{prefix}.warc.gz", "language": "en",
                     "language_score": float(rng.uniform(0.5, 1.0)), "token_count": 0, "score": score,
                     "int_score": int(round(score))})
    return rows


def write_fineweb(path: Path, rows: list[dict], raw_text: list[bytes | None] | None = None,
                  row_group_rows: int | None = None) -> Path:
    """Write rows in FineWeb-Edu's schema; raw_text (bytes, maybe invalid UTF-8) replaces the text column;
    row_group_rows: Parquet row groups of that many rows (default: one row group)."""
    columns = {name: [r[name] for r in rows] for name in SCHEMA.names}
    table = pa.table(columns, schema=SCHEMA)
    if raw_text is not None:
        text = pa.array(raw_text, pa.binary()).view(pa.string())  # no validation: invalid UTF-8 survives
        table = table.set_column(0, "text", text)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


def write_corpus(folder: Path, files: int = 3, docs_per_file: int = 60, seed: int = 0,
                 row_group_rows: int | None = None) -> Path:
    for f in range(files):
        write_fineweb(folder / f"part-{f:03d}.parquet", fineweb_rows(f"f{f}", docs_per_file, seed + f),
                      row_group_rows=row_group_rows)
    return folder
