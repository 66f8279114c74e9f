"""bench/nsa_settings.py on a CPU: what it cannot run is refused before the GPU starts (a setting NSAConfig refuses,
malformed lists and fields), its checked query ranges lie inside the sequence, and its table and heatmap come
from the rows a run records."""

import pytest

from bench.nsa_settings import CHECK_QUERIES, check_ranges, markdown, parse_args, plot, settings_grid


def test_the_grid_is_every_l_prime_and_n_over_the_paper_fields():
    args = parse_args(["--sel-block", "32,128", "--n-selected", "4,8", "--nsa", "window=256"])
    assert [(c.sel_block, c.n_selected) for c in args.grid] == [(32, 4), (32, 8), (128, 4), (128, 8)]
    assert {(c.cmp_block, c.cmp_stride, c.window) for c in args.grid} == {(32, 16, 256)}
    assert args.shapes == [("125m", 4, 8192), ("paper", 1, 65536)]  # the default string, parsed


@pytest.mark.parametrize("argv", [
    ["--sel-block", "24"],  # d = 16 does not divide l' = 24
    ["--sel-block", "16"],  # l = 32 > l'
    ["--n-selected", "2"],  # below the 3 forced blocks
    ["--sel-block", "32,32"], ["--n-selected", "x"], ["--nsa", "sel_block=32"], ["--nsa", "window=a"],
    ["--shapes", "huge:1:8"], ["--launch", "nothing"], ["--suffix", "a,b"],
])
def test_what_the_bench_cannot_run_is_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_a_refused_setting_is_named():
    with pytest.raises(ValueError, match="l'=24, n=16"):
        settings_grid([64, 24], [16], {})


@pytest.mark.parametrize("T", [1, 100, 300, 600, 65536])
def test_checked_ranges_are_disjoint_inside_the_sequence(T):
    ranges = check_ranges(T)
    covered = set().union(*(range(a, b) for a, b in ranges))
    c = min(CHECK_QUERIES, T)
    wanted = set(range(c)) | set(range(T // 2 - c // 2, T // 2 - c // 2 + c)) | set(range(T - c, T))
    assert covered == wanted  # the first, middle and last c queries, nothing else
    assert all(0 <= a < b <= T for a, b in ranges) and all(r[1] < s[0] for r, s in zip(ranges, ranges[1:]))
    if T > 3 * CHECK_QUERIES:
        assert len(ranges) == 3


def test_table_and_heatmap_from_a_run_s_rows(tmp_path):
    args = parse_args(["--shapes", "125m:1:4096", "--sel-block", "32,64", "--n-selected", "8,16"])
    base = {"family": "125m", "B": 1, "T": 4096}
    check = {"worst": 3.1e-3, "ok": True, "selection_rows_differing": 2, "selection_near_ties": 2}
    rows = [{**base, "kind": "dense", "cudnn_ms": 2.0, "cudnn_before_ms": 1.9, "cudnn_after_ms": 2.1},
            {**base, "kind": "nsa", "sel_block": 32, "n_selected": 8, "variant": "by_block", "nsa_ms": 1.5,
             "ratio": 0.75, "check": check, "kernel_ms": {"select_blocks_kernel": 0.25, "(others)": 1.0}},
            {**base, "kind": "nsa", "sel_block": 32, "n_selected": 16, "error": "RuntimeError('x')"},
            {**base, "kind": "nsa", "sel_block": 64, "n_selected": 16, "variant": "tiled_by_block", "nsa_ms": 2.5,
             "ratio": 1.25, "check": {**check, "ok": False}}]
    meta = {"device": "cpu", "date": "today", "commit": "abc", "torch": "t", "triton": "tr", "nsa_fields": {}}
    text = markdown(meta, rows, args.shapes, args.grid)
    assert "| 32 | 1.50 (0.750) [by_block] | error |" in text
    assert "| 64 | - | 2.50 (1.250) [tiled_by_block] |" in text
    assert "| l'=32 n=8 | 3.10e-03 | 2 (2) | yes |" in text and "| l'=64 n=16 | 3.10e-03 | 2 (2) | NO |" in text
    assert "dense cuDNN 2.00 ms (before the grid 1.90, after 2.10)" in text
    assert "- l'=32 n=8: select_blocks_kernel 0.25, (others) 1.00" in text
    plot(tmp_path / "heat.png", rows, args.shapes, args.grid)
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
