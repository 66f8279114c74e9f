"""The training loop under Ray Train on CPU (2 gloo workers, DDP; one run with parallelism=allreduce): resume
exactness, worker-failure recovery, the non-finite guard, the watchdog, and what the run leaves in MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from pipeline.config import load_job_config
from pipeline.train.trainer import run_pretraining
from test_train_support import losses_by_step, prepared_data_dir, run_overrides, share_block_sums, trace

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (pyproject.toml)
# Every run of the reference curve skips step 1 (NaN injected into rank 0's loss): the guard is exercised in
# each run and the curves of straight, stopped-and-resumed and killed runs must still match bitwise.
NAN_AT_1 = ("train.debug.nan_at_steps=[1]",)


@pytest.fixture(scope="module")
def packed():
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield prepared_data_dir()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def straight(packed, tmp_path_factory):
    """6 steps without interruption: the reference loss curve. With activation checkpointing (the other runs go
    without: recomputing the blocks in the backward must give the same curve bitwise) and only the latest
    checkpoint kept (of the two it writes)."""
    tmp = tmp_path_factory.mktemp("straight")
    extra = (*NAN_AT_1, "train.activation_checkpointing=true", "train.keep_checkpoints=1")
    result = run_pretraining(load_job_config(None, run_overrides(tmp, "straight", packed, *extra)))
    return result, losses_by_step(result.run_dir)


def check_own_shares(run_dir: str, packed: str) -> None:
    """Every traced micro-batch of rank r holds blocks of rank r's own share (their token sums), at the
    positions its block ids name (position = id // 2): each worker read its own data, nothing else."""
    sums = share_block_sums(packed, 2)
    for r in (0, 1):
        records = trace(run_dir, r)
        assert records
        for rec in records:
            assert all(b % 2 == r for b in rec["blocks"])
            assert rec["block_sums"] == [int(sums[r][b // 2]) for b in rec["blocks"]], (r, rec["step"])


def test_straight_run_reports_contract_metrics(straight, packed):
    result, losses = straight
    assert sorted(losses) == list(range(6))
    m = result.metrics
    for key in ("step", "tokens_seen", "train_loss", "lr", "tokens_per_s", "val_loss", "peak_mem_mb", "grad_norm",
                "data_wait_s", "compute_s", "skipped_steps", "nsa/gate_cmp"):
        assert key in m, key
    assert m["step"] == 6 and m["tokens_seen"] == 6 * 8 * 32 and m["skipped_steps"] == 1
    assert m["lr"] == pytest.approx(3e-4)  # min_lr at the last step
    assert 0 < m["val_loss"] < 9 and m["tokens_per_s"] > 0
    assert Path(result.checkpoint_path).name == "checkpoint_step_00000006"
    # CheckpointConfig(num_to_keep=1): the step-3 checkpoint was deleted once step 6's was reported
    assert sorted(p.name for p in Path(result.run_dir).glob("checkpoint_step_*")) == ["checkpoint_step_00000006"]
    # every rank consumed its own blocks of each step, all of them, once, from its own share
    blocks = sorted(b for r in (0, 1) for rec in trace(result.run_dir, r) for b in rec["blocks"])
    assert blocks == list(range(6 * 8))
    check_own_shares(result.run_dir, packed)


def test_stop_resume_and_worker_death_continue_the_same_loss_curve(straight, packed, tmp_path):
    """Stop after the step-3 checkpoint; rerun the same run name: it resumes at step 3; rank 1 then dies at
    step 4 and Ray Train restarts the workers from the step-3 checkpoint. The loss curve is the straight one."""
    _, reference = straight
    first = run_pretraining(load_job_config(None, run_overrides(tmp_path, "resumed", packed, *NAN_AT_1,
                                                                "train.debug.stop_after_step=3")))
    assert first.metrics["step"] == 3
    second = run_pretraining(load_job_config(None, run_overrides(
        tmp_path, "resumed", packed, *NAN_AT_1, "train.debug.fail_at_step=4", "train.debug.fail_rank=1",
        "train.max_failures=1")))
    assert second.metrics["step"] == 6 and second.metrics["skipped_steps"] == 1
    assert second.mlflow_run_id == first.mlflow_run_id  # one MLflow run across the restarts
    assert (Path(second.run_dir) / "debug" / "failed_at_step_4").exists()  # the fault really happened
    rank1 = trace(second.run_dir, 1)
    # stop after 3 steps; resume at step 3 (nothing repeated or skipped); die at step 4; redo step 3 from the
    # step-3 checkpoint in a new worker process
    assert [r["step"] for r in rank1] == [0, 1, 2, 3, 3, 4, 5]
    assert len({r["pid"] for r in rank1}) == 3
    assert losses_by_step(second.run_dir) == reference  # bitwise on CPU
    final = {}
    for r in (0, 1):
        for rec in trace(second.run_dir, r):
            final[(r, rec["step"])] = rec["blocks"]  # the last attempt of each step is what the model kept
    assert sorted(b for blocks in final.values() for b in blocks) == list(range(6 * 8))  # no block lost or repeated
    check_own_shares(second.run_dir, packed)  # also after the restarts: each rank continued its own share

    from mlflow.tracking import MlflowClient

    client = MlflowClient(second.tracking_uri)
    history = client.get_metric_history(second.mlflow_run_id, "train_loss")
    assert sorted(h.step for h in history) == [1, 2, 3, 4, 5, 6]  # step 4, replayed after the fault, logged once
    resumes = [(h.step, h.value) for h in client.get_metric_history(second.mlflow_run_id, "resumed_from_step")]
    assert resumes == [(3, 3.0), (3, 3.0)]  # the rerun of the run name, then the restarted worker
    lr = {h.step: h.value for h in client.get_metric_history(second.mlflow_run_id, "lr")}
    assert lr[2] == pytest.approx(3e-3) and lr[6] == pytest.approx(3e-4)  # warmup peak, then min_lr at the end
    # Startup, once a worker has run two steps: the fresh start at step 2 with its launch; the rerun died in its
    # second step; the restarted worker at step 5, resumed, so without a launch (its attempts before it would count)
    totals = client.get_metric_history(second.mlflow_run_id, "startup_total_s")
    assert sorted(h.step for h in totals) == [2, 5] and all(h.value > 0 for h in totals)
    assert [h.step for h in client.get_metric_history(second.mlflow_run_id, "startup_launch_s")] == [2]
    for counted in ("startup_nsa_kernels_compiled", "startup_fxgraph_cache_misses"):  # what each startup compiled
        assert sorted(h.step for h in client.get_metric_history(second.mlflow_run_id, counted)) == [2, 5]
    assert client.get_run(second.mlflow_run_id).info.status == "FINISHED"


def test_nan_steps_are_skipped_then_k_in_a_row_stop_the_run(packed, tmp_path):
    """Run with parallelism=allreduce (the other runs use DDP): rank 0's NaN reaches rank 1 through the one
    all-reduce of the gradient buffer, and both ranks skip the same steps."""
    with pytest.raises(Exception, match="2 consecutive steps with a non-finite loss"):
        run_pretraining(load_job_config(None, run_overrides(
            tmp_path, "nan", packed, "train.debug.nan_at_steps=[1, 4, 5]", "train.max_consecutive_nonfinite=2",
            "train.max_failures=0", "train.parallelism=allreduce")))
    run_dir = tmp_path / "ray_results" / "nan"
    assert (run_dir / "checkpoint_step_00000003" / "train_state.pt").exists()  # the last good checkpoint is kept
    recs = trace(str(run_dir), 0)
    assert [r["finite"] for r in recs] == [True, False, True, True, False]  # the run died in step 5
    assert [r["finite"] for r in trace(str(run_dir), 1)] == [True, False, True, True, False]  # rank 1 alike
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("nsa-pretrain").experiment_id])[0]
    skipped = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "skipped_steps")}
    assert skipped[1] == 0 and skipped[2] == 1 and skipped[5] == 2
    assert run.info.status == "FAILED"


def test_watchdog_fails_a_stalled_run_naming_step_and_phase(packed, tmp_path):
    with pytest.raises(Exception, match=r"watchdog: rank \d made no progress .* at step 1, phase 'data'"):
        run_pretraining(load_job_config(None, run_overrides(
            tmp_path, "stall", packed, "train.debug.stall_at_step=1", "train.watchdog_seconds=30",
            "train.max_failures=0")))
    dumps = list((tmp_path / "ray_results" / "stall" / "watchdog").glob("rank*-step1.txt"))
    assert dumps and "_inject_faults" in dumps[0].read_text()  # every thread's stack, the stalled one included


def test_mlflow_run_holds_params_metrics_artifacts_and_model(straight):
    from mlflow.tracking import MlflowClient

    result, _ = straight
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "straight"
    params = run.data.params
    assert params["train.max_steps"] == "6" and params["model.dim"] == "32" and params["model.nsa.window"] == "8"
    assert params["tokenizer.vocab_size"] == "4096" and len(params["tokenizer.sha256"]) == 64
    assert {h.step for h in client.get_metric_history(run.info.run_id, "train_loss")} == set(range(1, 7))
    assert {h.step for h in client.get_metric_history(run.info.run_id, "val_loss")} == {3, 6}
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    assert "nsa/gate_cmp" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "tokenizer", "model", "data_stats.json"} <= artifacts
    data_stats = client.download_artifacts(run.info.run_id, "data_stats.json")
    import json

    assert json.loads(Path(data_stats).read_text())["train"]["blocks"] > 0  # the prepared data's counts
    model_files = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "model")}
    assert model_files == {"model.pt", "config.yaml"}
    versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
    assert len(versions) == 1 and versions[0].name == "nsa-tiny"
    assert run.data.tags["ray_train_run_dir"] == result.run_dir
