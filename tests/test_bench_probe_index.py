"""bench/probe_index.py refuses a shape it cannot build before it starts on the GPU."""

import argparse

import pytest

from bench.probe_index import parse_shapes


def test_shapes_parse_as_family_batch_and_length():
    assert parse_shapes("125m:4:8192,paper:1:65536") == [("125m", 4, 8192), ("paper", 1, 65536)]


@pytest.mark.parametrize("bad", ["125m:4", "gpt:1:8192", "125m:0:8192", "125m:4:x", "125m:4:8192:1", ""])
def test_other_shapes_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_shapes(bad)
