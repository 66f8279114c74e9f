"""Deterministic train/validation split by document id.

A document is in validation when hash(id) / 2**64 < val_fraction. The hash is blake2b of the id (stable
across processes and Python versions, unlike hash()), so a document's split never depends on which files
are read, their order, or files added later.
"""

from __future__ import annotations

import hashlib

import numpy as np

SPLITS = ("train", "val")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")


def id_fraction(doc_id: str) -> float:
    digest = hashlib.blake2b(doc_id.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def in_split(doc_ids: list[str], split: str, val_fraction: float) -> np.ndarray:
    """Boolean mask: which of doc_ids belong to `split`."""
    check_split(split)
    is_val = np.fromiter((id_fraction(i) < val_fraction for i in doc_ids), dtype=bool, count=len(doc_ids))
    return is_val if split == "val" else ~is_val
