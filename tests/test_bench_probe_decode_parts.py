"""bench/probe_decode_parts.py refuses what it cannot run before it starts on the GPU: row counts of 0, and a
sweep without PARTS = 1, the value every other one's logits are checked against."""

import pytest

from bench.probe_decode_parts import parse_args


def test_row_counts_and_parts_parse_as_lists():
    args = parse_args(["--samples", "1,16,64", "--parts", "0,1,4"])
    assert args.samples == [1, 16, 64] and args.parts == [0, 1, 4]


@pytest.mark.parametrize("argv", [["--samples", "0,16"], ["--samples", "x"], ["--parts", "2,4"],
                                  ["--parts", "1,-2"], ["--suffix", "a b"]])
def test_what_the_probe_cannot_run_is_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)
