"""bench/probe_trial_start.py's record: its table reads each run's phases, its steady step, the Triton compilations
that missed the cache and the graph caches' hits; its plan of runs refuses what it cannot run (the GPU runs
themselves: kernels-notes.md v73, v74)."""

import argparse

import pytest

from bench.probe_trial_start import markdown, parse_runs, summary_line


def _run(name, eager=None):
    return {"name": name, "sel_block": 64, "n_selected": 8, "process_wall_s": 48.04, "import_s": 5.3,
            "cuda_init_s": 0.3, "model_s": 2.8, "compiled_steps_s": [34.2, 0.2, 0.2, 0.19, 0.16, 0.17],
            "eager_steps_s": eager,
            "compiles": [{"kernel": "range_attn_fwd_kernel", "s": 0.5, "cache_hit": False},
                         {"kernel": "select_blocks_kernel", "s": 2.0, "cache_hit": False},
                         {"kernel": "rope_split_kernel", "s": 0.01, "cache_hit": True}],
            "graph_caches": {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0, "autograd_cache_hit": 1,
                             "autograd_cache_miss": 0},
            "dynamo_compile_times": "TorchDynamo compilation metrics: ..."}


def test_a_runs_row_and_the_record():
    row = summary_line(_run("other-setting"))
    # steady: the fastest of the steps after the third; misses: 2 in 2.5 s; hits: 1
    assert row == ("| other-setting | 64 / 8 | 48.0 | 5.3 | 0.3 | 2.8 | - | - | 34.2 / 0.2 / 0.2 | 0.160 | 2 in 2.5 s "
                   "| 1 | 2 / 0 | 1 / 0 | - |")
    # the shared compile cache: what a cold run saved, what a new node's run loaded, and a problem said
    # (torch's artifacts + Triton's cache entries)
    assert summary_line({**_run("cold-compiled"), "shared_saved": 3, "shared_triton_saved": 41}).endswith(
        "| saved 3 + 41 |")
    assert summary_line({**_run("new-node"), "shared_loaded": 3, "shared_triton_loaded": 41, "shared_load_s": 0.24,
                         "shared_problems": ["could not save x"]}).endswith(
        "| loaded 3 + 41 in 0.2 s; could not save x |")
    # a run that compiled its NSA kernels before its steps (--precompile)
    assert "| 2.8 | 3.1 (20) | - |" in summary_line({**_run("cold-compiled"), "precompile_s": 3.14,
                                                     "precompiled_kernels": 20})
    assert "| 16.5 / 0.27 |" in summary_line(_run("cold-eager", eager=[16.5, 0.3, 0.27]))
    args = argparse.Namespace(compile_scope="model", preset="nsa-125m", seq_len=8192, accum=2, micro_batch=4,
                              compile_mode="reduce-overhead", precompile=False)
    meta = {"device": "NVIDIA H200", "date": "2026-11-30 22:25 UTC", "commit": "abc", "torch": "2.11", "triton": "3.6"}
    text = markdown(meta, args, [_run("other-setting")])
    assert text.startswith("# Where a trial's first steps go: NVIDIA H200, 2026-11-30 22:25 UTC")
    assert row in text and "those named -static by plain torch.compile" in text
    header = [line for line in text.splitlines() if line.startswith("| run |")][0]
    assert header.count("|") == row.count("|")  # a cell for every column
    slowest = text.split("slowest Triton compilations in the process")[1]
    assert slowest.index("select_blocks_kernel") < slowest.index("range_attn_fwd_kernel")  # slowest first


def test_the_plan_of_runs():
    runs = parse_runs("cold-compiled,other-block,cold-compiled-static,other-setting-static,cold-eager")
    # a form's first cold run fills its folder for the warm runs; a second cold run gets a fresh one
    assert [(name, setting, folder, form) for name, _, setting, folder, form in runs] == [
        ("cold-compiled", "base", "symbolic", "symbolic"), ("other-block", "other-block", "symbolic", "symbolic"),
        ("cold-compiled-static", "base", "static", "static"), ("other-setting-static", "other-n", "static", "static"),
        ("cold-eager", "base", "cold-eager", "symbolic")]
    # a new node's run has empty caches of its own; it reads the shared folder its form's cold run saved to
    new = parse_runs("cold-compiled,new-node,new-node-other,warm-compiled")
    assert [(name, setting, folder) for name, _, setting, folder, _ in new] == [
        ("cold-compiled", "base", "symbolic"), ("new-node", "base", "new-node"),
        ("new-node-other", "other-n", "new-node-other"), ("warm-compiled", "base", "symbolic")]
    with pytest.raises(argparse.ArgumentTypeError, match="put cold-compiled before it"):
        parse_runs("new-node")
    with pytest.raises(argparse.ArgumentTypeError, match="put cold-compiled-static before it"):
        parse_runs("cold-compiled,other-setting-static")  # the static form's caches were never filled
    with pytest.raises(argparse.ArgumentTypeError, match="unknown or repeated"):
        parse_runs("cold-compiled,cold-compiled")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown or repeated"):
        parse_runs("cold-compiled,hot")
