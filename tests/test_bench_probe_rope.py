"""bench/probe_rope.py refuses token counts its kernel cannot take (a program's rows are a power of two) before
it starts timing on the GPU."""

import argparse

import pytest

from bench.probe_rope import parse_tokens


def test_token_counts_parse_as_powers_of_two():
    assert parse_tokens("8,4,2,1") == [8, 4, 2, 1]


@pytest.mark.parametrize("bad", ["8,3", "0", "", "four", "8,-2"])
def test_other_token_counts_are_refused(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_tokens(bad)
