"""A real sweep on CPU: a 4-trial grid of a very small NSA model, a few steps each, through Ray Tune and Ray Train.

One sweep runs per module (it is the expensive part), and it is interrupted on the way: `jobs/sweep.py` starts it
in a subprocess whose driver is killed (SIGKILL) while the second trial runs, then run_sweep (Tuner.restore)
finishes it here. The tests read what it left: the summary, the Tune experiment, the trials' checkpoints, and the
MLflow parent and child runs (read back with MlflowClient).
"""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from mlflow.tracking import MlflowClient  # noqa: E402
from ray.tune import ExperimentAnalysis  # noqa: E402

from pipeline.config import load_job_config  # noqa: E402
from pipeline.tune import SUMMARY_COLUMNS, format_summary, init_ray, run_sweep  # noqa: E402
from test_tune_support import EXPERIMENT, OVERRIDES, REPO  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time (pyproject.toml)

# Every trial pauses after its step-1 checkpoint: the window in which the test kills the sweep's driver.
OVERRIDES = [*OVERRIDES, "train.debug.stall_at_step=1", "train.debug.stall_seconds=5"]


def _job(tmp: Path, name: str = "grid", extra: tuple[str, ...] = ()):
    return load_job_config(REPO / "configs" / "sweep-tiny.yaml", OVERRIDES + _paths(tmp, name) + list(extra))


def _session_pids(sid: int) -> list[int]:
    """Processes of the session a subprocess started (its Ray cluster included)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid:  # field 6 of stat: the session id
            pids.append(int(stat.parent.name))
    return pids


def _registered(trials: Path, trial_index: int, checkpoint: str) -> bool:
    """Whether trial `trial_index`'s Train run snapshot (what a restarted run resumes from) names `checkpoint`."""
    for snapshot in trials.glob(f"*_{trial_index:05d}/checkpoint_manager_snapshot.json"):
        try:
            if checkpoint in snapshot.read_text():
                return True
        except OSError:  # being written
            pass
    return False


def _kill_sweep_mid_trial(tmp: Path, trial_index: int) -> dict:
    """Start the sweep with jobs/sweep.py and SIGKILL its driver after trial `trial_index`'s step-1 checkpoint.

    Returns what the killed run left: its log, its MLflow parent run id, and the trials' folders then.
    """
    args = [arg for o in OVERRIDES + _paths(tmp, "grid") for arg in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    log_path = tmp / "killed-sweep.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "jobs/sweep.py", "--config", "configs/sweep-tiny.yaml", *args],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    trials = tmp / "ray" / "grid" / "trials"
    deadline = time.time() + 420
    try:
        # Kill once Ray Train has registered the step-1 checkpoint (its run snapshot names it), while the trainer
        # stalls 5 s in step 2. A run restarted without it in the snapshot starts from scratch; a fixed wait after
        # the folder appeared raced the registration on a loaded 2-core machine (a CI run saw no resume).
        while not _registered(trials, trial_index, "checkpoint_step_00000001"):
            assert proc.poll() is None, f"the sweep ended before it could be killed:\n{log_path.read_text()[-4000:]}"
            assert time.time() < deadline, f"trial {trial_index} did not checkpoint:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: its local Ray cluster shares its fate
        proc.wait()
        left = {d.name: sorted(c.name for c in d.glob("checkpoint_step_*")) for d in trials.iterdir()}
        deadline = time.time() + 60
        while _session_pids(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        for pid in _session_pids(proc.pid):  # whatever of that cluster is still there, and only it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log_path.read_text()
    parent = re.search(r"MLflow parent run (\w+)", text)
    assert parent, text[-4000:]
    return {"log": text, "parent_run_id": parent.group(1), "checkpoints": left}


def _paths(tmp: Path, name: str) -> list[str]:
    return [f"tune.name={name}", f"tune.storage_path={tmp / 'ray'}",
            f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    # The experiment first, so that run artifacts land under tmp instead of the repo's outputs/.
    MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}").create_experiment(EXPERIMENT, artifact_location=(tmp / "art").as_uri())
    killed = _kill_sweep_mid_trial(tmp, trial_index=1)
    init_ray(num_cpus=2)
    try:
        job = _job(tmp)
        result = run_sweep(job)  # Tuner.restore of the killed sweep
        print(format_summary(result.rows))  # shown with pytest -s (or -rA)
        yield tmp, job, result, killed
    finally:
        ray.shutdown()


def test_the_4_trial_grid_completes(sweep):
    tmp, job, result, killed = sweep
    rows = result.rows
    assert sorted((r["sel_block"], r["n_selected"]) for r in rows) == [(16, 4), (16, 8), (32, 4), (32, 8)]
    assert all(r["status"] in ("DONE", "STOPPED") for r in rows), rows  # no trial failed
    assert any(r["status"] == "DONE" and r["step"] == 4 and r["tokens_seen"] == 4 * 4 * 128 for r in rows)
    for r in rows:
        assert 2 <= r["step"] <= 4  # every trial validated at least once (ASHA's grace period is 2 steps)
        assert 0 < r["val_loss"] < 10 and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0 and r["startup_s"] > 0
    assert any(r["pareto"] for r in rows)
    with open(result.summary_csv) as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == SUMMARY_COLUMNS and len(table) == 4
    assert result.pareto_png.read_bytes()[:4] == b"\x89PNG"


def test_trials_ran_one_at_a_time_on_2_cpus(sweep):
    tmp, job, result, killed = sweep
    frames = ExperimentAnalysis(result.experiment_dir).trial_dataframes.values()
    spans = sorted((df["timestamp"].min(), df["timestamp"].max()) for df in frames if len(df))
    assert len(spans) == 4
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end  # max_concurrent_trials = 1 on 2 CPUs (a trial: 0.5 worker + 0.1 driver + 0.5 data)


def test_child_runs_hold_the_trials_nsa_settings(sweep):
    tmp, job, result, killed = sweep
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(result.parent_run_id)} >= {"summary.csv", "pareto.png"}
    assert parent.data.params["tune.sel_block"] == "[16, 32]"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert len(children) == 4
    by_trial = {c.data.tags["trial_id"]: c for c in children}
    for row in result.rows:
        child = by_trial[row["trial_id"]]
        assert child.info.run_id == row["mlflow_run_id"]
        params = child.data.params
        for field in ("sel_block", "n_selected", "cmp_block", "cmp_stride", "window"):
            assert params[f"nsa.{field}"] == str(row[field])
            assert params[f"model.nsa.{field}"] == str(row[field])  # the config the trainer really ran
        metrics = child.data.metrics
        assert metrics["trial.val_loss"] == pytest.approx(row["val_loss"])
        assert metrics["trial.tokens_per_s"] == pytest.approx(row["tokens_per_s"])
        assert "trial.peak_mem_mb" in metrics and "train_loss" in metrics  # the trainer's own metrics too
        assert metrics["trial.startup_s"] == pytest.approx(row["startup_s"])
        assert 0 < metrics["startup_first_step_s"] < metrics["startup_total_s"]  # the trainer's breakdown
        assert 0 <= metrics["startup_first_step_data_wait_s"] <= metrics["startup_first_step_s"]  # and its batches'
        assert child.info.status == ("FINISHED" if row["status"] == "DONE" else "KILLED")
    # Each child run lasts as long as its trial (the trials ran one at a time), not until the sweep's summary
    spans = sorted((c.info.start_time, c.info.end_time) for c in children)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans
    # The settings reach the model: at step 2 (every trial gets there), sparse selection (l'=16, n=4 of 8 blocks)
    # changes the loss against selecting all 8 blocks, while l'=32 (4 blocks) gives the same function for n=4 and 8.
    val2 = {}
    for row in result.rows:
        history = client.get_metric_history(row["mlflow_run_id"], "val_loss")
        val2[(row["sel_block"], row["n_selected"])] = next(m.value for m in history if m.step == 2)
    same_function = abs(val2[(32, 4)] - val2[(32, 8)])
    sparse_vs_all = abs(val2[(16, 4)] - val2[(16, 8)])
    assert sparse_vs_all > 0 and sparse_vs_all > 10 * same_function, val2


def test_rerun_with_the_same_name_restores_the_sweep(sweep):
    tmp, job, result, killed = sweep
    again = run_sweep(job)  # Tuner.restore: every trial is already finished, none runs again
    assert again.parent_run_id == result.parent_run_id
    assert sorted(r["trial_id"] for r in again.rows) == sorted(r["trial_id"] for r in result.rows)
    assert {r["trial_id"]: r["val_loss"] for r in again.rows} == {r["trial_id"]: r["val_loss"] for r in result.rows}
    client = MlflowClient(result.tracking_uri)
    children = client.search_runs([client.get_run(result.parent_run_id).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'")
    assert len(children) == 4  # no trial was launched again
    changed = _job(tmp, extra=("tune.n_selected=[4]",))
    with pytest.raises(ValueError, match="different config"):
        run_sweep(changed)
    saved = json.loads((Path(result.experiment_dir) / "sweep_config.json").read_text())
    assert saved["max_steps"] == 4


def test_a_sweep_killed_mid_trial_resumes_that_trial_from_its_checkpoint(sweep):
    tmp, job, result, killed = sweep
    assert "sweep: resuming" not in killed["log"]  # the killed run was the sweep's first
    by_index = {r["trial_id"].rsplit("_", 1)[1]: r for r in result.rows}
    first, killed_trial = by_index["00000"], by_index["00001"]
    # When the driver died, trial 0 had finished and trial 1's latest checkpoint was its step 1 (of 4).
    assert killed["checkpoints"][first["trial_id"]][-1] == "checkpoint_step_00000004"
    assert killed["checkpoints"][killed_trial["trial_id"]][-1] == "checkpoint_step_00000001"
    assert set(killed["checkpoints"]) == {first["trial_id"], killed_trial["trial_id"]}  # trials 2, 3 not started
    # The same MLflow parent run, and no duplicate child runs: one per trial.
    assert result.parent_run_id == killed["parent_run_id"]
    client = MlflowClient(result.tracking_uri)
    experiment_id = client.get_run(result.parent_run_id).info.experiment_id
    runs = client.search_runs([experiment_id])
    assert len(runs) == 5 and sorted(r.data.tags.get("trial_id", "-") for r in runs) == sorted(
        ["-", *(r["trial_id"] for r in result.rows)])
    # Trial 1 went on from its step-1 checkpoint (once); no other trial resumed: trial 0 was not run again.
    for row in result.rows:
        resumes = [(m.step, m.value) for m in client.get_metric_history(row["mlflow_run_id"], "resumed_from_step")]
        assert resumes == ([(1, 1.0)] if row is killed_trial else []), (row["trial_id"], resumes)
    # Every step of every trial is logged once. The killed trial's workers may outlive its driver by seconds and
    # log steps past the checkpoint; the resumed trial replays those steps without logging them again.
    for row in result.rows:
        steps = [m.step for m in client.get_metric_history(row["mlflow_run_id"], "train_loss")]
        assert sorted(steps) == list(range(1, row["step"] + 1)), (row["trial_id"], steps)
    assert killed_trial["step"] >= 2 and killed_trial["status"] in ("DONE", "STOPPED")
