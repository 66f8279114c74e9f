"""What the data stage did, counted: documents read, dropped and altered by reason, tokens, blocks.

`DataStats` is a plain dataclass (merged by addition; `to_dict()` flattens it for MLflow).
A `StatsRecorder` is a small Ray actor that the packing stage updates after each batch, so the
driver or a training worker can read the live counts of a streaming dataset at any time
(`recorder.snapshot()`); the final partial block is known once the stream has ended.
Each rank's pipeline records as its own part (its rank); `snapshot()` sums the parts, `snapshot(part=r)`
is rank r's own counts (what its pipeline read: fragments, documents, tokens, blocks).
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
    fragments_read: int = 0  # source Parquet fragments (file, row group) read by the stream
    documents_read: int = 0  # rows of this split read from the source files
    documents_other_split: int = 0  # rows that belong to the other split (by id hash), not counted below
    documents_kept: int = 0  # documents that reached the tokenizer (before long-document splitting)
    dropped: Counter = field(default_factory=Counter)  # reason -> documents
    altered: Counter = field(default_factory=Counter)  # reason -> documents
    pieces: int = 0  # documents after splitting long ones (each ends with one EOS)
    document_tokens: int = 0  # tokens of the pieces, EOS excluded
    eos_tokens: int = 0
    blocks: int = 0  # full blocks packed (including any skipped by start_block)
    partial_block_tokens: int = 0  # tokens left in the final, incomplete block(s) (not trained on), summed over ranks

    def add(self, other: "DataStats") -> None:
        """Sum every count (the packer sets partial_block_tokens itself after adding its chunks' counts, which
        hold none; summing over ranks adds each rank's final partial block)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            else:
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


def _progress(d: dict) -> tuple[int, int]:
    return d["documents_read"] + d["documents_other_split"], d["blocks"]


@ray.remote(num_cpus=0)
class _StatsStore:
    def __init__(self):
        self._by_part: dict[str, dict[str, dict]] = {}  # part -> execution -> counts

    def update(self, part: str, execution: str, stats: dict) -> None:
        self._by_part.setdefault(part, {})[execution] = stats

    def parts(self) -> dict[str, dict]:
        """Per part, the execution that got furthest (a complete pass beats a later, partial one)."""
        return {part: max(runs.values(), key=_progress) for part, runs in self._by_part.items()}


class StatsRecorder:
    """Pass to block_dataset(..., stats=recorder); read with snapshot(). Picklable (holds an actor handle).

    Every execution of a dataset (each epoch) records under its own key and its part (the rank whose share
    it reads; "manifest" for prepared data). Per part the execution that got furthest counts (an epoch that
    ended, rather than the next one just begun); snapshot() sums the parts, snapshot(part) is one of them.
    """

    def __init__(self):
        self._store = _StatsStore.remote()

    def record(self, execution: str, stats: DataStats, part: int | str = 0) -> None:
        ray.get(self._store.update.remote(str(part), execution, stats.to_json()))

    def snapshot(self, part: int | str | None = None) -> DataStats | None:
        parts = ray.get(self._store.parts.remote())
        if part is not None:
            d = parts.get(str(part))
            return None if d is None else DataStats.from_json(d)
        if not parts:
            return None
        total = DataStats()
        for d in parts.values():
            total.add(DataStats.from_json(d))
        return total

    @staticmethod
    def new_execution_id() -> str:
        return uuid.uuid4().hex
