"""bench/sweep_report.py: a sweep's record read back from an MLflow file store shaped as jobs/sweep.py leaves it."""

import argparse
import json
import math

import pytest

from bench.sweep_report import main, parse_baseline

# (l', n, init seed) -> tokens/s of the reports at steps 10, 20, 30, 40 and the validation loss at step 40. Step 10 is
# inside the sweep's throughput warm-up: its slow report must not count.
TRIALS = {(64, 16, 1337): ([1000.0, 400.0, 410.0, 420.0], 2.50), (32, 8, 1337): ([50.0, 600.0, 630.0, 615.0], 2.56),
          (128, 8, 1337): ([10.0, 300.0, 290.0, 310.0], 2.47)}


def _store(path, monkeypatch, sweep="sweep-x", trials=TRIALS, with_startup=False):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file:{path}")
    exp = client.create_experiment("nsa-sweep")
    parent = client.create_run(exp, run_name=sweep).info.run_id
    client.log_param(parent, "tune.throughput_warmup_steps", 10)
    client.log_param(parent, "tune.token_budget", 4000)
    for (sel, n, seed), (speeds, val) in trials.items():
        run = client.create_run(exp, run_name=f"{sweep}/t{sel}-{n}-{seed}", start_time=1_000_000, tags={
            "mlflow.parentRunId": parent, "trial_id": f"t{sel}-{n}-{seed}", "sweep.status": "DONE"}).info.run_id
        client.log_param(run, "nsa.sel_block", sel)
        client.log_param(run, "nsa.n_selected", n)
        if seed is not None:
            client.log_param(run, "train.seed", seed)
        for i, tps in enumerate(speeds):
            step = 10 * (i + 1)
            for key, value in (("tokens_per_s", tps), ("mfu", tps / 2000), ("train_loss", 3.0 - step / 100),
                               ("peak_mem_mb", 1000.0 + step), ("data_wait_s", 0.01), ("step_time_s", 0.1)):
                client.log_metric(run, key, value, step=step)
        client.log_metric(run, "val_loss", val + 0.3, step=20)
        client.log_metric(run, "val_loss", val, step=40)
        if with_startup:  # the trial's start (step 20), then a resume's (step 40) that must not replace it
            for step, scale in ((20, 1.0), (40, 0.5)):
                for phase, seconds in (("launch", 15.0), ("model", 3.0), ("kernels", 2.5), ("compile_cache", 0.25),
                                       ("data", 4.0),
                                       ("first_step", 30.0), ("second_step", 0.5), ("total", 55.0)):
                    client.log_metric(run, f"startup_{phase}_s", seconds * scale * sel / 64, step=step)
                for count, value in (("nsa_kernels_compiled", 10), ("nsa_compile_s", 8.25), ("nsa_kernels_cached", 11),
                                     ("fxgraph_cache_hits", 2), ("fxgraph_cache_misses", 0),
                                     ("compile_cache_loaded", 3), ("compile_cache_saved", 0),
                                     ("compile_cache_triton_loaded", 20), ("compile_cache_triton_saved", 0)):
                    client.log_metric(run, f"startup_{count}", value * scale * sel / 64, step=step)
            client.set_terminated(run, "FINISHED", end_time=1_000_000 + 1000 * sel)  # a trial of l' seconds
    return path


def _record(tmp_path, store, *extra):
    assert main(["--mlruns", str(store), "--sweep", "sweep-x", "--device", "test", "--commit", "abc",
                 "--out", str(tmp_path / "out"), "--tag=-t1", *extra]) == 0
    (record,) = (tmp_path / "out").glob("sweep-*-t1.json")
    md = next((tmp_path / "out").glob("sweep-*-t1.md")).read_text()
    data = json.loads(record.read_text())
    return {(s["setting"]["sel_block"], s["setting"]["n_selected"]): s for s in data["settings"]}, data["trials"], md


def test_each_setting_against_the_baseline_setting(tmp_path, monkeypatch):
    rows, trials, md = _record(tmp_path, _store(tmp_path / "mlruns", monkeypatch))
    assert rows[(64, 16)]["baseline"] and rows[(64, 16)]["tokens_per_s"] == 410.0  # step 10's 1000 left out
    assert rows[(32, 8)]["tokens_per_s_ratio"] == pytest.approx(615.0 / 410.0)
    assert rows[(128, 8)]["tokens_per_s_ratio"] == pytest.approx(300.0 / 410.0)
    assert (rows[(128, 8)]["tokens_per_s_min"], rows[(128, 8)]["tokens_per_s_max"]) == (290.0, 310.0)
    assert rows[(32, 8)]["val_losses"] == [2.56] and rows[(32, 8)]["val_step"] == 40
    assert rows[(32, 8)]["val_loss_diff"] == pytest.approx(0.06)
    assert rows[(128, 8)]["val_loss_diff"] == pytest.approx(-0.03)
    assert rows[(64, 16)]["peak_mem_mb"] == 1040.0 and [t["steady_reports"] for t in trials] == [3, 3, 3]
    assert "| 32 | 8 | 1 DONE | 615 (600-630) | 1.500 |" in md and "(baseline)" in md
    assert "| trial |" not in md  # one seed a setting: no per-trial table
    record = json.loads(next((tmp_path / "out").glob("sweep-*-t1.json")).read_text())
    assert record["token_budget"] == 4000 and record["warmup_steps"] == 10


def test_settings_over_several_init_seeds(tmp_path, monkeypatch):
    trials = {**TRIALS, (64, 16, 7): ([1.0, 430.0, 430.0, 430.0], 2.70), (32, 8, 7): ([1.0, 590.0, 585.0, 595.0], 2.52)}
    rows, per_trial, md = _record(tmp_path, _store(tmp_path / "mlruns", monkeypatch, trials=trials))
    base, fast = rows[(64, 16)], rows[(32, 8)]
    assert base["init_seeds"] == [7, 1337] and base["trials"] == 2 and base["tokens_per_s"] == pytest.approx(420.0)
    assert base["val_loss"] == pytest.approx(2.60) and base["val_loss_range"] == pytest.approx(0.20)
    assert fast["val_loss_diff"] == pytest.approx((2.52 + 2.56) / 2 - 2.60)
    assert fast["tokens_per_s_ratio"] == pytest.approx((590.0 + 615.0) / 2 / 420.0)
    assert [(t["setting"]["sel_block"], t["init_seed"]) for t in per_trial] == [(32, 7), (32, 1337), (64, 7),
                                                                               (64, 1337), (128, 1337)]
    assert "| trial | l' | n | init seed |" in md and "2.7000, 2.5000" in md


def test_a_baseline_no_trial_ran_is_an_error(tmp_path, monkeypatch):
    store = _store(tmp_path / "mlruns", monkeypatch)
    with pytest.raises(SystemExit, match="0 settings match it"):
        main(["--mlruns", str(store), "--sweep", "sweep-x", "--device", "test", "--commit", "abc",
              "--out", str(tmp_path / "out"), "--baseline", "sel_block=64,n_selected=32"])
    with pytest.raises(SystemExit, match="no run named 'other'"):
        main(["--mlruns", str(store), "--sweep", "other", "--device", "t", "--commit", "a", "--out", str(tmp_path)])


def test_a_run_that_is_not_a_sweep_trial_is_an_error(tmp_path, monkeypatch):
    store = _store(tmp_path / "mlruns", monkeypatch, trials={**TRIALS, (32, 16, None): ([1.0, 2.0, 3.0, 4.0], 2.0)})
    with pytest.raises(SystemExit, match="has no parameter 'train.seed'"):
        main(["--mlruns", str(store), "--sweep", "sweep-x", "--device", "t", "--commit", "a", "--out", str(tmp_path)])


def test_baseline_is_parsed_strictly():
    assert parse_baseline("sel_block=64,n_selected=16") == {"sel_block": 64, "n_selected": 16}
    for bad in ("sel_block=6x", "block=64", "sel_block"):
        with pytest.raises(argparse.ArgumentTypeError, match="want FIELD=INT"):
            parse_baseline(bad)


def test_each_trials_startup_is_its_first_report_and_a_settings_the_mean(tmp_path, monkeypatch):
    trials = {**TRIALS, (64, 16, 7): ([1.0, 430.0, 430.0, 430.0], 2.70)}
    rows, per_trial, md = _record(tmp_path, _store(tmp_path / "mlruns", monkeypatch, trials=trials, with_startup=True))
    first = {(t["setting"]["sel_block"], t["init_seed"]): t["startup"] for t in per_trial}
    assert first[(128, 1337)] == {"launch": 30.0, "model": 6.0, "kernels": 5.0, "compile_cache": 0.5, "data": 8.0,
                                  "first_step": 60.0,
                                  "second_step": 1.0, "total": 110.0}  # step 20's, not the resumed halves (40)
    assert rows[(64, 16)]["startup_s"] == pytest.approx(55.0) and rows[(32, 8)]["startup_s"] == pytest.approx(27.5)
    assert per_trial[-1]["compiles"] == {"nsa_kernels_compiled": 20, "nsa_compile_s": 16.5, "nsa_kernels_cached": 22,
                                         "fxgraph_cache_hits": 4, "fxgraph_cache_misses": 0,
                                         "compile_cache_loaded": 6, "compile_cache_saved": 0,
                                         "compile_cache_triton_loaded": 40, "compile_cache_triton_saved": 0}
    # t128-8, step 20's; the phases in the loop's order (the shared cache before the kernels, which it feeds)
    assert ("| t128-8-1337 | 128 | 8 | 1337 | 30.0 | 6.0 | 0.5 | 5.0 | 8.0 | 60.0 | 1.0 | 110.0 | 20 (16.5) | 22 | "
            "4 / 0 | 6 + 40 / 0 + 0 | 128.0 |") in md
    assert rows[(32, 8)]["wall_s"] == 32.0
    bare, _, bare_md = _record(tmp_path / "bare", _store(tmp_path / "bare" / "mlruns", monkeypatch))
    assert all(math.isnan(s["startup_s"]) for s in bare.values())  # a store from before stop 76: shown as "-"
    assert "| t64-16-1337 | 64 | 16 | 1337 |" + " - |" * 13 in bare_md  # never ended
