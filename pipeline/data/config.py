"""DataConfig: where the text comes from, how it becomes tokens, and how tokens become blocks.

Validated when built (ValueError naming the field), so `DataConfig(**yaml_dict)` refuses a bad
config before any file is read or any Ray task starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

# Tokenizer specs that are not a file path or an HF name.
EMBEDDED = "embedded"
BYTES = "bytes"
TIKTOKEN_PREFIX = "tiktoken:"
# URI schemes we read through fsspec (hf:// via huggingface_hub.HfFileSystem); "file" is local.
EMBEDDED_SCOPES = ("stdlib", "installed")  # pipeline.data.corpus.SCOPES
KNOWN_SCHEMES = ("file", "hf", "s3", "gs", "gcs", "az", "abfs", "abfss", "memory", "http", "https")


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"DataConfig.{name}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DataConfig:
    # Where documents come from: "embedded" (the built-in corpus), a local Parquet file or folder, or a
    # URI: hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT, s3://..., gs://...
    source: str = EMBEDDED
    # What the embedded corpus holds: "stdlib" (Python's own docs, ~2.3M chars) or "installed" (also the
    # docstrings and docs of every installed package: tens of millions of chars, built once, minutes).
    embedded_scope: str = "stdlib"
    # "embedded" (the project's BPE trained on the embedded corpus), "bytes", "tiktoken:<encoding>",
    # a tokenizer.json path, or an HF name/path (transformers.AutoTokenizer, offline).
    tokenizer: str = EMBEDDED
    eos_token: str | None = None  # EOS token text; None: the tokenizer's own (or <|endoftext|>)
    seq_len: int = 256  # a block holds seq_len + 1 tokens (inputs and shifted labels)
    val_fraction: float = 0.05  # share of documents (by id hash) held out for validation
    min_int_score: int | None = None  # FineWeb-Edu int_score threshold (0..5); None keeps all
    min_language_score: float | None = None  # language_score threshold (0..1); None keeps all
    max_doc_chars: int = 100_000  # longer documents are split into pieces of at most this many chars
    shuffle_seed: int = 0  # seeds the file order
    max_files: int | None = None  # read only the first N files after shuffling (small runs)
    packed_dir: str | None = None  # read prepared blocks (jobs/prepare_data.py) instead of streaming
    output_dir: str = "outputs"  # embedded corpus, tokenizer and prepared blocks go under here
    text_column: str = "text"
    id_column: str = "id"
    read_batch_rows: int = 1024  # documents tokenized per encode_batch call
    # Concurrent tokenizing tasks of one rank's pipeline (each training rank streams its own share); None: the
    # cluster's CPUs at dataset build divided by the number of ranks (at least 1).
    tokenize_tasks: int | None = None
    # Concurrent read tasks of one rank's stream of prepared blocks (data.packed_dir), each split. A task reads a
    # row group in milliseconds, so two keep a GPU fed; uncapped, Ray Data starts a worker process for every quarter
    # CPU free, and those starts took the CPUs of the run's kernel compiles (kernels-notes v80).
    read_tasks: int = 2
    shard_blocks: int = 4096  # blocks per prepared Parquet shard
    # Blocks per Parquet row group of a prepared shard: the unit dealt to training ranks (pipeline/data/shards.py),
    # so two ranks' shares of prepared data differ by at most this many blocks, and a split needs at least one row
    # group per rank. 64: 256 KiB at seq_len 2048; the tiny config's held-out split (~130 blocks) still splits.
    row_group_blocks: int = 64
    # Embedded BPE training (also the defaults of the tokenizer training stage).
    vocab_size: int = 4096
    tokenizer_train_docs: int = 20_000

    def __post_init__(self) -> None:
        for name in ("source", "tokenizer", "output_dir", "text_column", "id_column"):
            value = getattr(self, name)
            _require(isinstance(value, str) and value.strip() != "", name, f"must be a non-empty string, got {value!r}")
        _require(self.embedded_scope in EMBEDDED_SCOPES, "embedded_scope",
                 f"must be one of {EMBEDDED_SCOPES}, got {self.embedded_scope!r}")
        scheme = self.source.split("://", 1)[0] if "://" in self.source else None
        _require(scheme is None or scheme in KNOWN_SCHEMES, "source",
                 f"unknown URI scheme {scheme!r} in {self.source!r}; known: {KNOWN_SCHEMES} or a local path")
        if self.tokenizer.startswith(TIKTOKEN_PREFIX):
            _require(len(self.tokenizer) > len(TIKTOKEN_PREFIX), "tokenizer",
                     f"'tiktoken:' needs an encoding name, e.g. tiktoken:cl100k_base; got {self.tokenizer!r}")
        _require(self.eos_token is None or (isinstance(self.eos_token, str) and self.eos_token != ""),
                 "eos_token", f"must be None or a non-empty string, got {self.eos_token!r}")
        for name in ("seq_len", "max_doc_chars", "read_batch_rows", "shard_blocks", "row_group_blocks", "vocab_size",
                     "tokenizer_train_docs"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, name, f"must be a positive int, got {value!r}")
        _require(_is_int(self.shuffle_seed) and self.shuffle_seed >= 0, "shuffle_seed",
                 f"must be an int >= 0, got {self.shuffle_seed!r}")
        _require(_is_number(self.val_fraction) and 0.0 <= self.val_fraction < 1.0, "val_fraction",
                 f"must be a number in [0, 1), got {self.val_fraction!r}")
        _require(self.min_int_score is None or (_is_int(self.min_int_score) and 0 <= self.min_int_score <= 5),
                 "min_int_score", f"must be None or an int in 0..5, got {self.min_int_score!r}")
        _require(self.min_language_score is None
                 or (_is_number(self.min_language_score) and 0.0 <= self.min_language_score <= 1.0),
                 "min_language_score", f"must be None or a number in [0, 1], got {self.min_language_score!r}")
        _require(self.max_files is None or (_is_int(self.max_files) and self.max_files > 0), "max_files",
                 f"must be None or a positive int, got {self.max_files!r}")
        _require(self.tokenize_tasks is None or (_is_int(self.tokenize_tasks) and self.tokenize_tasks > 0),
                 "tokenize_tasks", f"must be None or a positive int, got {self.tokenize_tasks!r}")
        _require(_is_int(self.read_tasks) and self.read_tasks > 0, "read_tasks",
                 f"must be a positive int, got {self.read_tasks!r}")
        _require(self.packed_dir is None or (isinstance(self.packed_dir, str) and self.packed_dir != ""),
                 "packed_dir", f"must be None or a non-empty path, got {self.packed_dir!r}")
        _require(self.vocab_size >= 257, "vocab_size",
                 f"must be >= 257 (256 bytes + EOS) for the embedded BPE, got {self.vocab_size}")

    @property
    def block_len(self) -> int:
        """Tokens per packed block: seq_len inputs plus one for the shifted labels."""
        return self.seq_len + 1

    def resolve_path(self, path: str) -> str:
        """An absolute local path (Ray workers may run in another directory); URIs are kept."""
        return path if "://" in path else os.path.abspath(os.path.expanduser(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "DataConfig":
        return dataclasses.replace(self, **changes)
