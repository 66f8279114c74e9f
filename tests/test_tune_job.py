"""jobs/sweep.py through `ray job submit` to a head node this test starts on loopback (tests/test_job_pretrain.py's
ray_head fixture): the job joins that cluster, runs a 2-trial sweep to SUCCEEDED, and leaves its MLflow parent and
child runs where the config says."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest
from test_job_pretrain import cluster_env, ray_head  # noqa: F401 (ray_head is a fixture)
from test_tune_support import OVERRIDES, REPO

pytestmark = pytest.mark.timeout(900)


def test_ray_job_submit_runs_a_sweep_on_a_started_head(ray_head, tmp_path):  # noqa: F811
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    sets = [*OVERRIDES, "tune.n_selected=[4]", "tune.scheduler=fifo", "tune.token_budget=1024",  # 2 trials of 2 steps
            "train.checkpoint_every=0", "tune.name=submitted", f"tune.storage_path={tmp_path / 'ray'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"data.output_dir={REPO / 'outputs'}"]
    submission_id = f"sweep-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", ray_head, "--submission-id", submission_id, "--no-wait",
         "--working-dir", ".", "--", "python", "jobs/sweep.py", *(a for s in sets for a in ("--set", s))],
        cwd=REPO, env=cluster_env(), capture_output=True, text=True, timeout=300)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    client = JobSubmissionClient(ray_head)
    deadline = time.time() + 600
    while (status := client.get_job_status(submission_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                    JobStatus.STOPPED}:
        assert time.time() < deadline, "job did not finish in time"
        time.sleep(3)
    logs = client.get_job_logs(submission_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    assert "sweep: joined the Ray cluster" in logs
    assert "1 trial(s) at a time: the joined cluster has 2 CPU now and a trial needs 1.1 CPU" in logs
    assert "sweep submitted: 2 trials, 0 settings refused" in logs
    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = mlflow.get_run(json.loads((tmp_path / "ray" / "submitted" / "mlflow_run.json").read_text())["run_id"])
    assert parent.info.status == "FINISHED" and f"MLflow parent run: {parent.info.run_id}" in logs
    assert {a.path for a in mlflow.list_artifacts(parent.info.run_id)} >= {"summary.csv", "pareto.png"}
    children = mlflow.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted((c.data.params["nsa.sel_block"], c.info.status) for c in children) == [
        ("16", "FINISHED"), ("32", "FINISHED")]
