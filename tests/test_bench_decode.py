"""bench/decode.py: checks the cached logits before it times anything, and writes its result files."""

from __future__ import annotations

import json

import pytest

from bench import decode


def test_decode_bench_checks_then_times_both_paths(tmp_path):
    decode.main(["--prompt-len", "40", "--new-tokens", "3", "--check-steps", "2", "--repeats", "1",
                 "--out", str(tmp_path), "--commit", "abc1234"])
    (md,) = tmp_path.glob("decode-cpu-*.md")
    result = json.loads(md.with_suffix(".json").read_text())
    assert result["commit"] == "abc1234" and result["prompt_len"] == 40
    assert [r["preset"] for r in result["rows"]] == ["tiny", "tiny-dense"] and result["samples"] == 1
    for row in result["rows"]:
        assert row["check"]["steps_max"] <= 1e-9 and row["check"]["prompt_max"] <= 1e-9
        assert row["check"]["steps"] == 2
        assert row["same_tokens"] and row["cached"]["tokens_per_s"] > 0 and row["full"]["tokens_per_s"] > 0
    assert "| tiny | " in md.read_text()


def test_decode_bench_times_samples_drawn_together_against_one_at_a_time(tmp_path):
    decode.main(["--prompt-len", "24", "--new-tokens", "3", "--samples", "3", "--check-steps", "1", "--repeats",
                 "1", "--out", str(tmp_path), "--suffix=-samples"])
    (md,) = tmp_path.glob("decode-cpu-*-samples.md")
    result = json.loads(md.with_suffix(".json").read_text())
    assert result["samples"] == 3
    for row in result["rows"]:
        assert row["baseline"] == "one_at_a_time" and "full" not in row and row["same_tokens"]
        assert row["cached"]["tokens_per_s"] > 0 and row["one_at_a_time"]["tokens_per_s"] > 0
    assert "| model | 3 samples together, tokens/s | one sample at a time (cached), tokens/s |" in md.read_text()


def test_decode_bench_leaves_room_for_more_checked_steps_than_timed_ones(tmp_path):
    decode.main(["--prompt-len", "10", "--new-tokens", "1", "--check-steps", "6", "--repeats", "1",
                 "--out", str(tmp_path)])
    (md,) = tmp_path.glob("decode-cpu-*.json")
    assert all(row["check"]["steps"] == 6 for row in json.loads(md.read_text())["rows"])


def test_decode_bench_refuses_cached_logits_that_are_off(tmp_path, monkeypatch):
    from nsa_model.model import Transformer

    cached = Transformer.forward_cached

    def off_by_a_little(self, tokens, cache):
        return cached(self, tokens, cache) * (1 + 1e-6)
    monkeypatch.setattr(Transformer, "forward_cached", off_by_a_little)
    with pytest.raises(AssertionError, match="cached logits off the full pass's"):
        decode.main(["--prompt-len", "20", "--new-tokens", "2", "--check-steps", "1", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--prompt-len", "0"], ["--device", "tpu"], ["--suffix", "a,b"]])
def test_decode_bench_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit):
        decode.parse_args(argv)


def test_relative_error_in_row_chunks_is_the_whole_computation():
    """The check's error a few rows at a time (a 128k prompt's float64 logits would not fit at once) is the
    per-row error computed whole, including a last chunk shorter than the others."""
    import torch

    gen = torch.Generator().manual_seed(0)
    want = torch.randn(10, 7, generator=gen, dtype=torch.float64)
    got = want + 1e-3 * torch.randn(10, 7, generator=gen, dtype=torch.float64)
    whole = (got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))
    chunked = decode.relative_error(got, want, rows=3)
    assert chunked.shape == (10,) and torch.equal(chunked, whole)
