"""What the data stage did, counted: documents read, dropped and altered by reason, tokens, blocks.

`DataStats` is a plain dataclass (merged by addition; `to_dict()` flattens it for MLflow).
A `StatsRecorder` is a small Ray actor that the packing stage updates after each batch, so the
driver or a training worker can read the live counts of a streaming dataset at any time
(`recorder.snapshot()`); the final partial block is known once the stream has ended.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray


@dataclass
class DataStats:
    documents_read: int = 0  # rows of this split read from the source files
    documents_other_split: int = 0  # rows that belong to the other split (by id hash), not counted below
    documents_kept: int = 0  # documents that reached the tokenizer (before long-document splitting)
    dropped: Counter = field(default_factory=Counter)  # reason -> documents
    altered: Counter = field(default_factory=Counter)  # reason -> documents
    pieces: int = 0  # documents after splitting long ones (each ends with one EOS)
    document_tokens: int = 0  # tokens of the pieces, EOS excluded
    eos_tokens: int = 0
    blocks: int = 0  # full blocks packed (including any skipped by start_block)
    partial_block_tokens: int = 0  # tokens left in the final, incomplete block (not trained on)

    def add(self, other: "DataStats") -> None:
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            elif f.name != "partial_block_tokens":  # a position, not a sum: the packer sets it
                setattr(self, f.name, mine + theirs)

    @property
    def stream_tokens(self) -> int:
        return self.document_tokens + self.eos_tokens

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dropped"], d["altered"] = dict(sorted(self.dropped.items())), dict(sorted(self.altered.items()))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DataStats":
        d = dict(d)
        d["dropped"], d["altered"] = Counter(d.get("dropped", {})), Counter(d.get("altered", {}))
        return cls(**d)

    def to_dict(self, prefix: str = "") -> dict[str, int]:
        """Flat {name: count} for metrics, e.g. dropped.empty_text."""
        flat = {}
        for key, value in self.to_json().items():
            if isinstance(value, dict):
                flat.update({f"{prefix}{key}.{reason}": n for reason, n in value.items()})
            else:
                flat[f"{prefix}{key}"] = value
        return flat


@ray.remote(num_cpus=0)
class _StatsStore:
    def __init__(self):
        self._by_execution: dict[str, dict] = {}
        self._latest: str | None = None

    def update(self, execution: str, stats: dict) -> None:
        self._by_execution[execution] = stats
        self._latest = execution

    def latest(self) -> dict | None:
        return None if self._latest is None else self._by_execution[self._latest]


class StatsRecorder:
    """Pass to block_dataset(..., stats=recorder); read with snapshot(). Picklable (holds an actor handle).

    Each execution of the dataset (each epoch, each worker iterating its own copy) records under its own
    key; snapshot() returns the most recently updated one.
    """

    def __init__(self):
        self._store = _StatsStore.remote()

    def record(self, execution: str, stats: DataStats) -> None:
        ray.get(self._store.update.remote(execution, stats.to_json()))

    def snapshot(self) -> DataStats | None:
        d = ray.get(self._store.latest.remote())
        return None if d is None else DataStats.from_json(d)

    @staticmethod
    def new_execution_id() -> str:
        return uuid.uuid4().hex
