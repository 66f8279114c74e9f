"""The benches' shape arguments, parsed and checked in one place: comma-separated family:B:T (a model family's
heads and head dims, B sequences of T tokens) or B:T."""

from __future__ import annotations

import argparse

from nsa_model.config import NSAConfig

# heads, kv groups and head dim of the two configurations ANCHORS.md times
FAMILIES = {"125m": dict(H=12, G=2, D=64), "paper": dict(H=64, G=4, D=128)}
# the NSA settings of the paper and of ANCHORS.md's timings (l, d, l', n, w): every issue-4 row runs at these
PAPER_NSA = NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=16, window=512)
# the five rows issue 4 sets targets for (bench/kernels.py TARGETS): the probes' default shapes
ISSUE4_SHAPES = "125m:16:2048,125m:4:8192,125m:1:32768,paper:1:8192,paper:1:65536"


def _positive_ints(item: str, parts: list[str], form: str) -> list[int]:
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{item!r}: B and T must be integers ({form})") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{item!r}: B and T must be >= 1")
    return values


def family_shapes(text: str, families=FAMILIES) -> list[tuple[str, int, int]]:
    """family:B:T items, in the order given; family one of `families` (names)."""
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"{item!r}: expected family:B:T, e.g. 125m:4:8192")
        if parts[0] not in families:
            raise argparse.ArgumentTypeError(f"{item!r}: family must be one of {sorted(families)}")
        B, T = _positive_ints(item, parts[1:], "family:B:T")
        shapes.append((parts[0], B, T))
    return shapes


def batch_shapes(text: str) -> list[tuple[int, int]]:
    """B:T items, in the order given."""
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"{item!r}: expected B:T, e.g. 4:8192")
        B, T = _positive_ints(item, parts, "B:T")
        shapes.append((B, T))
    return shapes
