"""The sweep's pure parts: its config, the search space and its validity filter, throughput, the Pareto front."""

import csv
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest

from nsa_model.config import get_preset
from pipeline.tune import (
    SUMMARY_COLUMNS,
    ThroughputTracker,
    ClusterView,
    TuneConfig,
    _check_same_sweep,
    by_setting,
    candidate_settings,
    check_sweep,
    format_summary,
    full_setting,
    pareto_front,
    plot_pareto,
    split_valid,
    steps_for_budget,
    summarize,
    sweep_record,
    trial_concurrency,
    write_summary_csv,
)


def test_config_defaults_are_a_4_trial_grid_valid_for_tiny():
    cfg = TuneConfig()
    settings = candidate_settings(cfg)
    assert settings == [{"sel_block": 16, "n_selected": 4}, {"sel_block": 16, "n_selected": 8},
                        {"sel_block": 32, "n_selected": 4}, {"sel_block": 32, "n_selected": 8}]
    valid, rejected = split_valid(settings, get_preset("tiny"))
    assert valid == settings and rejected == []


@pytest.mark.parametrize("field, value, message", [
    ("sel_block", [], "TuneConfig.sel_block"),
    ("sel_block", [16, 0], "TuneConfig.sel_block"),
    ("n_selected", [4, 4], "duplicates"),
    ("search", "bayes", "TuneConfig.search"),
    ("scheduler", "pbt", "TuneConfig.scheduler"),
    ("token_budget", 0, "TuneConfig.token_budget"),
    ("reduction_factor", 1, "TuneConfig.reduction_factor"),
    ("max_concurrent_trials", 0, "TuneConfig.max_concurrent_trials"),
    ("name", "a/b", "TuneConfig.name"),
    ("init_seeds", [], "TuneConfig.init_seeds"),
    ("init_seeds", [1, 1], "TuneConfig.init_seeds"),
    ("init_seeds", [-1], "TuneConfig.init_seeds"),
    ("init_seeds", [True], "TuneConfig.init_seeds"),
])
def test_config_refuses_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        TuneConfig(**{field: value})


def test_config_from_dict_refuses_unknown_fields_and_takes_yaml_lists():
    with pytest.raises(ValueError, match="unknown field.*sel_blocks"):
        TuneConfig.from_dict({"sel_blocks": [16]})
    with pytest.raises(ValueError, match="sweeps nothing"):
        TuneConfig.from_dict({"sel_block": None, "n_selected": None})
    cfg = TuneConfig.from_dict({"sel_block": [32], "n_selected": None, "window": [32, 64], "init_seeds": [0, 7]})
    assert cfg.sel_block == (32,) and cfg.window == (32, 64) and cfg.init_seeds == (0, 7)
    assert TuneConfig.from_dict(cfg.to_dict()) == cfg


def test_invalid_combinations_are_filtered_with_a_logged_reason(caplog):
    # tiny: cmp_block=16, cmp_stride=8. sel_block=12 is not a multiple of the stride; sel_block=8 < cmp_block;
    # n_selected=2 < n_init_blocks + n_local_blocks = 3.
    cfg = TuneConfig(sel_block=(8, 12, 16), n_selected=(2, 4))
    with caplog.at_level(logging.WARNING, logger="pipeline.tune"):
        valid, rejected = split_valid(candidate_settings(cfg), get_preset("tiny"))
    assert valid == [{"sel_block": 16, "n_selected": 4}]
    assert len(rejected) == 5
    reasons = {(r.setting["sel_block"], r.setting["n_selected"]): r.reason for r in rejected}
    assert "must divide sel_block" in reasons[(12, 4)]
    assert "cmp_block: must be <= sel_block" in reasons[(8, 4)]
    assert "n_selected" in reasons[(16, 2)]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 5
    assert any("sel_block=12, n_selected=4" in m and "must divide sel_block" in m for m in skipped)


def test_full_setting_fills_unswept_fields_from_the_model():
    tiny = get_preset("tiny")
    assert full_setting(tiny, {"sel_block": 32}) == {
        "sel_block": 32, "n_selected": tiny.nsa.n_selected, "cmp_block": tiny.nsa.cmp_block,
        "cmp_stride": tiny.nsa.cmp_stride, "window": tiny.nsa.window}


def test_throughput_leaves_out_warmup_and_takes_the_median():
    tracker = ThroughputTracker(warmup_steps=2)
    for step, tps, mem in [(1, 10.0, 5.0), (2, 20.0, 9.0), (3, 100.0, 7.0), (4, 300.0, 6.0), (5, 110.0, None)]:
        tracker.add({"step": step, "tokens_per_s": tps, "peak_mem_mb": mem})
    tracker.add({"step": 6, "val_loss": 3.0})  # a validation-only report carries no throughput
    assert tracker.tokens_per_s() == 110.0
    assert tracker.peak_mem_mb == 9.0
    assert math.isnan(tracker.startup_s)
    tracker.add({"step": 7, "startup_total_s": 42.5})  # the run's one startup report
    assert tracker.startup_s == 42.5
    assert math.isnan(ThroughputTracker(warmup_steps=10).tokens_per_s())


def test_pareto_front_on_a_hand_made_example():
    #            A      B      C      D      E      F(dup of B)  G(no loss)    H      I
    tps = [100.0, 200.0, 150.0, 300.0, 50.0, 200.0, 1000.0, 90.0, 300.0]
    loss = [3.0, 3.5, 3.6, 5.0, 2.9, 3.5, float("nan"), 3.0, 5.5]
    # C is dominated by B (faster and lower loss); A, B, D, E trade off; F ties B exactly so neither dominates;
    # G has no validation loss, so it is neither on the front nor dominating anything (else it would hide D);
    # H has A's loss but is slower, I has D's throughput but a higher loss: both dominated.
    assert pareto_front(tps, loss) == [True, True, False, True, True, True, False, False, False]
    assert pareto_front([], []) == []
    with pytest.raises(ValueError, match="pareto_front"):
        pareto_front([1.0], [])


def _rows():
    rows = []
    for i, (sel, n, tps, loss, status) in enumerate([
            (16, 4, 100.0, 3.0, "DONE"), (16, 8, 80.0, 3.2, "DONE"), (32, 4, 120.0, 3.1, "DONE"),
            (32, 8, float("nan"), float("nan"), "ERROR"),
            (64, 4, 500.0, 2.0, "STOPPED")]):  # faster and lower loss than all, but from fewer tokens
        rows.append({"trial_id": f"t{i}", "sel_block": sel, "n_selected": n, "cmp_block": 16, "cmp_stride": 8,
                     "window": 64, "status": status, "step": 10 if status == "DONE" else 4, "tokens_seen": 1000,
                     "tokens_per_s": tps, "val_loss": loss, "peak_mem_mb": 1.0, "mlflow_run_id": f"r{i}"})
    return rows


def test_summary_csv_table_and_plot(tmp_path):
    rows = summarize(_rows())
    assert [r["trial_id"] for r in rows] == ["t4", "t0", "t2", "t1", "t3"]  # by validation loss, missing last
    # The front is among trials that trained the whole budget: the early-stopped t4 neither joins nor dominates.
    assert {r["trial_id"]: r["pareto"] for r in rows} == {"t0": True, "t2": True, "t1": False, "t3": False,
                                                          "t4": False}
    write_summary_csv(rows, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv") as f:
        read = list(csv.DictReader(f))
    assert tuple(read[0]) == SUMMARY_COLUMNS and [r["trial_id"] for r in read] == ["t4", "t0", "t2", "t1", "t3"]
    text = format_summary(rows)
    assert text.splitlines()[0].split()[:3] == ["trial_id", "sel_block", "n_selected"] and len(text.splitlines()) == 6
    plot_pareto(rows, tmp_path / "pareto.png", "test")
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_with_several_seeds_the_front_is_drawn_on_each_settings_mean(tmp_path):
    """A lucky seed must not put a setting on the front: A's seeds give 3.0 and 3.4 (mean 3.2); B, as fast as A,
    gives 3.1 and 3.1. Per trial, A's 3.0 would tie the front; on means, B dominates A."""
    rows = []
    for i, (sel, seed, tps, loss) in enumerate([(16, 0, 100.0, 3.0), (16, 1, 100.0, 3.4), (32, 0, 102.0, 3.1),
                                                (32, 1, 98.0, 3.1), (64, 0, 50.0, 2.5), (64, 1, 52.0, 2.9)]):
        rows.append({"trial_id": f"t{i}", "sel_block": sel, "n_selected": 4, "cmp_block": 16, "cmp_stride": 8,
                     "window": 64, "init_seed": seed, "status": "DONE", "step": 10, "tokens_seen": 1000,
                     "tokens_per_s": tps, "val_loss": loss, "peak_mem_mb": 1.0, "mlflow_run_id": f"r{i}"})
    means = {s["sel_block"]: s for s in by_setting(rows)}
    assert means[16]["val_loss"] == pytest.approx(3.2) and means[16]["trials"] == 2
    assert (means[64]["val_loss_min"], means[64]["val_loss_max"]) == (2.5, 2.9) and means[32]["tokens_per_s"] == 100.0
    flagged = {r["trial_id"]: r["pareto"] for r in summarize(rows)}
    assert flagged == {"t0": False, "t1": False, "t2": True, "t3": True, "t4": True, "t5": True}
    rows[5]["status"] = "STOPPED"  # a setting with a trial stopped early leaves the front
    assert {r["trial_id"]: r["pareto"] for r in summarize(rows)}["t4"] is False
    write_summary_csv(summarize(rows), tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv") as f:
        assert sorted(r["init_seed"] for r in csv.DictReader(f)) == ["0", "0", "0", "1", "1", "1"]
    plot_pareto(summarize(rows), tmp_path / "pareto.png", "seeds")
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trial_trains_from_its_init_seed():
    from pipeline.tune import SweepPlan

    job = _sweep_job()
    plan = SweepPlan(job=job, tune=job.tune, max_steps=12, experiment_dir="/tmp/s", parent_run_id="p")
    assert plan.trial_job({"sel_block": 32}, "t0", 5).train.seed == 5
    assert plan.trial_job({"sel_block": 32}, "t0").train.seed == job.train.seed


def _sweep_job(*overrides):
    from pipeline.config import load_job_config

    return load_job_config(Path(__file__).resolve().parent.parent / "configs" / "sweep-tiny.yaml", list(overrides))


def test_gpu_sweep_config_plans_six_settings_one_trial_a_gpu():
    from pipeline.config import load_job_config

    job = load_job_config(Path(__file__).resolve().parent.parent / "configs" / "sweep-125m-gpu.yaml")
    valid, rejected = split_valid(candidate_settings(job.tune), job.model)
    assert len(valid) == 6 and rejected == [] and job.train.use_gpu and job.data.seq_len == 8192
    steps = steps_for_budget(job, job.tune.token_budget)
    assert steps == 80
    check_sweep(job, valid, steps)
    n, why = trial_concurrency(job, len(valid), ClusterView(fixed_size=True, now={"GPU": 2.0, "CPU": 32.0}, max=None))
    assert n == 2 and "a trial needs 1 GPU" in why


def test_sweep_tiny_config_plans_24_steps_and_one_trial_at_a_time_on_2_cpus():
    job = _sweep_job()
    assert steps_for_budget(job, job.tune.token_budget) == 24  # 49152 tokens / (8 blocks x 256 tokens)
    assert steps_for_budget(job, 2049) == 2  # rounded up: at least the budget
    # 2 workers x 0.5 CPU + 0.1 for the trial's driver + 0.5 for its data pipeline: 1.6 CPU a trial
    n, why = trial_concurrency(job, 4, _local({"CPU": 2.0}))
    assert n == 1 and "local cluster has 2 CPU and a trial needs 1.6 CPU" in why


def _local(now):
    return ClusterView(fixed_size=True, now=now, max=None)


def _joined(now, ceiling=None):
    return ClusterView(fixed_size=False, now=now, max=ceiling)


def test_trial_concurrency_on_fixed_and_autoscaling_clusters():
    cpu, gpu = _sweep_job(), _sweep_job("train.use_gpu=true", "train.precision=bf16")  # gpu: 2 GPUs a trial
    # A cluster this process started: what it has is all there is; never more than the sweep's trials.
    assert trial_concurrency(cpu, 20, _local({"CPU": 16.0}))[0] == 10
    assert trial_concurrency(cpu, 4, _local({"CPU": 16.0}))[0] == 4
    assert trial_concurrency(gpu, 8, _local({"CPU": 64.0, "GPU": 8.0}))[0] == 4
    with pytest.raises(ValueError, match="a trial needs 2 GPU but this local cluster has 1"):
        trial_concurrency(gpu, 8, _local({"CPU": 64.0, "GPU": 1.0}))
    # A joined cluster autoscaling from zero GPU nodes: the autoscaler's maximum where it reports one...
    n, why = trial_concurrency(gpu, 8, _joined({"CPU": 8.0}, ceiling={"CPU": 200.0, "GPU": 6.0}))
    assert n == 3 and "autoscaler can grow the cluster to 6 GPU" in why
    with pytest.raises(ValueError, match="grow the cluster to 1 GPU at most"):
        trial_concurrency(gpu, 8, _joined({"CPU": 8.0}, ceiling={"CPU": 200.0, "GPU": 1.0}))
    # ...else every trial starts and waits for its nodes (not 0, not 1)...
    n, why = trial_concurrency(gpu, 8, _joined({"CPU": 8.0}))
    assert n == 8 and "waits for the nodes the autoscaler adds" in why
    # ...and where the capacity is there already (asked for ahead, or a fixed cluster), what it holds.
    n, why = trial_concurrency(gpu, 8, _joined({"CPU": 64.0, "GPU": 4.0}))
    assert n == 2 and "set tune.max_concurrent_trials" in why
    # Set explicitly, it wins everywhere (capped at the sweep's trials).
    three = _sweep_job("tune.max_concurrent_trials=3")
    for cluster in (_local({"CPU": 2.0}), _joined({}), _joined({"CPU": 64.0}, ceiling={"CPU": 1.0})):
        assert trial_concurrency(three, 8, cluster) == (3, "tune.max_concurrent_trials=3 (the sweep has 8 trials)")
    assert trial_concurrency(three, 2, _joined({}))[0] == 2


@pytest.mark.parametrize("overrides, message", [
    (["tune.grace_period=24"], "tune.grace_period: must be < the trial's 24 steps"),
    (["train.val_every=16"], "train.val_every: must be <= tune.grace_period"),
    (["train.val_every=0"], "train.val_every: must be > 0 in a sweep"),
    (["tune.token_budget=2048"], "tune.token_budget: gives 1 steps"),
])
def test_a_sweep_that_cannot_work_is_refused_before_it_starts(overrides, message):
    job = _sweep_job(*overrides)
    with pytest.raises(ValueError, match=message):
        check_sweep(job, candidate_settings(job.tune), steps_for_budget(job, job.tune.token_budget))
    fifo = _sweep_job("tune.scheduler=fifo", "tune.grace_period=24")
    check_sweep(fifo, candidate_settings(fifo.tune), 24)  # no ASHA, no grace period to respect
    with pytest.raises(ValueError, match="no valid combination"):
        check_sweep(fifo, [], 24)


def test_resuming_a_sweep_with_a_changed_config_is_refused(tmp_path):
    record = {"tune": TuneConfig().to_dict(), "max_steps": 24, "settings": [{"sel_block": 16}]}
    _check_same_sweep(str(tmp_path / "s"), record)  # first run: records it
    _check_same_sweep(str(tmp_path / "s"), json.loads(json.dumps(record)))  # same sweep: resumes
    with pytest.raises(ValueError, match="tune.name: .* different config"):
        _check_same_sweep(str(tmp_path / "s"), {**record, "max_steps": 12})


def test_the_sweep_record_changes_with_the_experiment_not_with_its_concurrency():
    job = _sweep_job()
    settings = candidate_settings(job.tune)
    record = sweep_record(job, settings, 24)
    assert record == sweep_record(_sweep_job("tune.max_concurrent_trials=2"), settings, 24)
    assert record == json.loads(json.dumps(record))  # what the file holds compares equal after a round trip
    for changed in (["model.dim=128"], ["train.lr=1e-3"], ["tune.grace_period=4"], ["data.seq_len=128"],
                    ["tune.init_seeds=[0, 1]"]):
        assert record != sweep_record(_sweep_job(*changed), settings, 24), changed
    assert record != sweep_record(job, settings[:2], 24)


def test_sweep_script_refuses_a_bad_config_before_starting():
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "jobs/sweep.py", "--set", "tune.sel_block=[16, 0]"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "config error: " in proc.stderr
    assert "TuneConfig.sel_block: must hold positive ints only, got 0" in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr  # refused before any cluster was started


def test_prepared_data_folder_changes_with_what_selects_the_blocks(tmp_path):
    """The sweep reuses <output_dir>/packed/<name> when it exists: a run on fewer files or other filters must not
    land in (or read) the folder of the full data."""
    from pipeline.data import DataConfig, default_packed_dir

    base = DataConfig(tokenizer="bytes", output_dir=str(tmp_path))
    full = default_packed_dir(base)
    assert full.name.endswith("-L256-v0.05-s0")  # the default data keeps its name (folders prepared before)
    others = [base.replace(**change) for change in (
        {"max_files": 1}, {"min_int_score": 3}, {"min_language_score": 0.9}, {"max_doc_chars": 1000},
        {"eos_token": "<eos>"}, {"text_column": "body"}, {"seq_len": 128}, {"val_fraction": 0.1},
        {"shuffle_seed": 1})]
    names = {default_packed_dir(c) for c in others}
    assert full not in names and len(names) == len(others)
    assert default_packed_dir(base.replace(shard_blocks=8, read_batch_rows=7)) == full  # layout only
    a, b = (default_packed_dir(base.replace(source=f"/data/{d}/train.parquet")) for d in ("a", "b"))
    assert a != b  # same file name, other data



@pytest.mark.parametrize("search", ["grid", "random"])
def test_search_space_holds_only_the_valid_settings(search):
    """Tune's own variant expansion of the space: the grid gives each valid setting once per sample; random search
    draws num_samples of them, never a refused one."""
    from ray.tune.search.variant_generator import generate_variants

    from pipeline.tune import param_space

    cfg = TuneConfig(sel_block=(8, 12, 16, 32), n_selected=(2, 4, 8), search=search,
                     num_samples=2 if search == "grid" else 12)
    valid, rejected = split_valid(candidate_settings(cfg), get_preset("tiny"))
    assert len(valid) == 4 and len(rejected) == 8
    space = param_space(cfg, valid)
    drawn = [variant["nsa"] for _ in range(cfg.num_samples) for _, variant in generate_variants(space)]
    if search == "grid":
        assert drawn == valid * 2
    else:
        assert len(drawn) == 12 and all(d in valid for d in drawn) and len({str(d) for d in drawn}) > 1
    # With init seeds every setting runs once per seed (grid), or each draw takes one of them (random).
    seeded = dataclasses.replace(cfg, init_seeds=(3, 4))
    drawn = [(str(v["nsa"]), v["init_seed"]) for _ in range(cfg.num_samples)
             for _, v in generate_variants(param_space(seeded, valid))]
    if search == "grid":
        assert sorted(drawn) == sorted([(str(v), seed) for v in valid for seed in (3, 4)] * cfg.num_samples)
    else:
        assert {seed for _, seed in drawn} <= {3, 4} and len(drawn) == 12
