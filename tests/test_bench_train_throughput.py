"""bench/train_throughput.py's arithmetic: steady-state numbers from interval reports, ratios against targets."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "train_throughput", Path(__file__).resolve().parent.parent / "bench" / "train_throughput.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def report(step, step_time_s, *, tokens_per_step=100, wait=0.0, mem=10.0, mfu_per_tps=None):
    r = {"step": step, "tokens_seen": step * tokens_per_step, "step_time_s": step_time_s, "data_wait_s": wait,
         "peak_mem_mb": mem, "train_loss": 1.0, "skipped_steps": 0, "tokens_per_s": tokens_per_step / step_time_s}
    if mfu_per_tps is not None:
        r["mfu"] = mfu_per_tps * r["tokens_per_s"]
    return r


def test_steady_state_leaves_out_the_warmup_interval_and_weights_by_time():
    # warm-up interval (steps 1-2) is slow; then 2 steps at 1 s and 2 steps at 3 s: 400 tokens in 8 s
    reports = [report(2, 50.0, mem=5), report(4, 1.0, wait=0.1, mem=30, mfu_per_tps=0.001),
               report(6, 3.0, wait=0.1, mem=20, mfu_per_tps=0.001)]
    s = tt.steady_state(reports, warmup=2)
    assert s["steps_measured"] == 4
    assert s["tokens_per_s"] == pytest.approx(400 / 8)
    assert s["step_time_s"] == pytest.approx(2.0)
    assert s["data_wait_share"] == pytest.approx(0.4 / 8)
    assert s["peak_mem_mb"] == 30
    assert s["mfu"] == pytest.approx(0.001 * 400 / 8)


def test_steady_state_refuses_a_run_with_only_the_warmup():
    with pytest.raises(ValueError, match="no report after the warm-up"):
        tt.steady_state([report(3, 1.0)], warmup=3)


def run(tokens_per_s, peak_mem_mb):
    return {"tokens_per_s": tokens_per_s, "peak_mem_mb": peak_mem_mb, "step_time_s": 1.0, "data_wait_share": 0.0,
            "train_loss_last": 1.0}


def test_compare_ratios_and_verdicts():
    runs = {("nsa", 2048): run(80.0, 10.0), ("dense", 2048): run(100.0, 10.0),
            ("nsa", 32768): run(150.0, 12.0), ("dense", 32768): run(100.0, 10.0),
            ("nsa", 8192): {"error": "OutOfMemoryError"}, ("dense", 8192): run(1.0, 1.0)}
    rows = {r["seq_len"]: r for r in tt.compare(runs)}
    assert rows[2048]["speed_ratio"] == pytest.approx(0.8) and rows[2048]["status"] == "speed met"
    assert rows[32768]["speed_ratio"] == pytest.approx(1.5)
    assert rows[32768]["status"] == "speed NOT met, memory NOT met"
    assert rows[8192]["status"].startswith("incomplete")
    assert "| 2048 | 0.800 | 0.7 |" in tt.markdown(
        {"device": "d", "date": "x", "commit": "c", "torch": "t", "preset": "p", "tokens_per_step": 1,
         "micro_tokens": 1, "warmup": 1, "measure": 1, "config": "f", "compile_note": "n"}, runs, tt.compare(runs))


def test_compare_under_cuda_graphs_takes_the_reserved_peak():
    """Under CUDA graphs the activations live in the graphs' pools, which the allocated peak does not see."""
    nsa, dense = run(160.0, 5.0), run(100.0, 6.0)
    nsa["peak_reserved_mb"], dense["peak_reserved_mb"] = 24.0, 21.0
    runs = {("nsa", 32768): nsa, ("dense", 32768): dense}
    assert tt.compare(runs)[0]["status"] == "speed met, memory met"  # allocated: 5 <= 6
    row = tt.compare(runs, "peak_reserved_mb")[0]
    assert row["memory_ratio"] == pytest.approx(24 / 21) and row["status"] == "speed met, memory NOT met"


def test_under_cuda_graphs_the_report_counts_graphs_run_without_them():
    reports = [report(2, 5.0), report(4, 1.0)]
    assert "cudagraph_skips" not in tt.steady_state(reports, warmup=2)  # default mode: nothing to count
    reports[-1]["cudagraph_skips"] = 1.0
    nsa = tt.steady_state(reports, warmup=2)
    assert nsa["cudagraph_skips"] == 1
    runs = {("nsa", 2048): {**run(80.0, 10.0), **nsa}, ("dense", 2048): run(100.0, 10.0)}
    meta = {"device": "d", "date": "x", "commit": "c", "torch": "t", "preset": "p", "tokens_per_step": 1,
            "micro_tokens": 1, "warmup": 1, "measure": 1, "config": "f", "compile_note": "n"}
    assert "(inductor's cudagraph_skips, per worker process): nsa T=2048: 1." in tt.markdown(meta, runs,
                                                                                             tt.compare(runs))


def test_run_overrides_keep_tokens_per_step_equal():
    o = tt.run_overrides(preset="nsa-125m", attention="dense", seq_len=8192, tokens_per_step=65536,
                         micro_tokens=32768, warmup=3, measure=6, storage="/tmp/x")
    assert "model.preset=nsa-125m-dense" in o and "train.global_batch=8" in o and "train.micro_batch=4" in o
    with pytest.raises(ValueError, match="multiples of T"):
        tt.run_overrides(preset="p", attention="nsa", seq_len=3000, tokens_per_step=65536, micro_tokens=32768,
                         warmup=3, measure=6, storage="/tmp/x")


def test_per_kind_overrides_reach_only_their_kind_and_the_header_names_them():
    args = tt.parse_args(["--config", "c.yaml", "--set", "train.lr=1e-3",
                          "--nsa-set", "train.attention_recompute=true"])
    nsa, dense = (tt.job_overrides(args, "nsa-125m", kind, 2048, "/tmp/x") for kind in ("nsa", "dense"))
    assert nsa[:2] == ["train.lr=1e-3", "train.attention_recompute=true"] and "model.preset=nsa-125m" in nsa
    assert "train.attention_recompute=true" not in dense and dense[0] == "train.lr=1e-3"
    runs = {("nsa", 2048): run(80.0, 10.0), ("dense", 2048): run(100.0, 10.0)}
    meta = {"device": "d", "date": "x", "commit": "c", "torch": "t", "preset": "p", "tokens_per_step": 1,
            "micro_tokens": 1, "warmup": 1, "measure": 1, "config": "f", "compile_note": "n",
            "nsa_overrides": args.nsa_set, "dense_overrides": args.dense_set}
    header = tt.markdown(meta, runs, tt.compare(runs)).splitlines()[2]
    assert header.endswith("; nsa only: train.attention_recompute=true")


def test_a_tag_the_gpu_host_cannot_return_is_refused_before_anything_runs(capsys):
    """Result files come back from a GPU host only with names of letters, digits, '.', '_' and '-' (a tag with a
    comma lost two runs' files, kernels-notes v35): the tag is refused at parsing, with the reason."""
    with pytest.raises(SystemExit):
        tt.parse_args(["--config", "c.yaml", "--tag=-v35-nsa,dense"])
    assert "may hold only letters, digits" in capsys.readouterr().err
    assert tt.parse_args(["--config", "c.yaml", "--tag=-v35_nsa-dense.2"]).tag == "-v35_nsa-dense.2"


def test_a_benchmark_that_runs_past_midnight_writes_one_pair_of_files(tmp_path, monkeypatch):
    """The results are written after every run; their name (with its date) is taken once, when the benchmark
    starts, so a call that runs into the next UTC day rewrites one pair of files instead of leaving a partial pair
    under the first date (it did, kernels-notes v46)."""
    import ray

    real_stem, days = tt.result_stem, iter(range(26, 40))

    def next_day_each_call(out_dir, prefix, suffix, commit):  # the clock moves a day between two calls
        stem, meta = real_stem(out_dir, prefix, suffix, commit)
        return stem.with_name(f"{prefix}-cpu-2026-11-{next(days)}{suffix}"), meta

    monkeypatch.setattr(tt, "result_stem", next_day_each_call)
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(tt, "train_once", lambda job, path: [report(2, 5.0), report(4, 1.0)])
    assert tt.main(["--config", "configs/tiny.yaml", "--seq-lens", "64", "--tokens-per-step", "256",
                    "--micro-tokens", "128", "--warmup", "2", "--measure", "2", "--commit", "abc1234",
                    "--out", str(tmp_path), "--tag=-v46"]) == 0
    assert sorted(f.name for f in tmp_path.iterdir()) == ["train-cpu-2026-11-26-v46.json",
                                                          "train-cpu-2026-11-26-v46.md"]
    written = json.loads((tmp_path / "train-cpu-2026-11-26-v46.json").read_text())
    assert sorted(r["attention"] for r in written["runs"]) == ["dense", "nsa"]
