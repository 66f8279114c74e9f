"""jobs/pretrain.py end to end: as a script (its own local Ray cluster, streaming data), through
`ray job submit` to a head node this module starts on loopback, and its refusal of a bad config; and jobs/sweep.py
through `ray job submit` to the same head."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ports import free_ports
from test_train_support import REPO, SEQ_LEN, SMALL_MODEL

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (pyproject.toml)
VENV_BIN = Path(sys.executable).parent


def job_overrides(tmp_path: Path, name: str) -> list[str]:
    """A 4-step run of the small model streaming two corpus files (Ray Data reads, tokenizes and packs), one for
    each of the 2 workers: a file of the embedded corpus is one row group, the unit dealt to workers."""
    sets = [*SMALL_MODEL, f"data.seq_len={SEQ_LEN}", "data.max_files=2", f"data.output_dir={REPO / 'outputs'}",
            "train.global_batch=4", "train.micro_batch=2", "train.max_steps=4", "train.warmup_steps=1",
            "train.log_every=2", "train.val_every=0", "train.val_batches=1", "train.checkpoint_every=2",
            f"train.run_name={name}", f"train.storage_path={tmp_path / 'ray_results'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.experiment=job-test"]
    return [arg for s in sets for arg in ("--set", s)]


def env_without_ray_address() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


def cluster_env() -> dict[str, str]:
    # Ray 2.60's `ray start` turns token authentication on (token in ~/.ray/auth_token); its clients (the CLI,
    # JobSubmissionClient) send the token only in token mode.
    return {**env_without_ray_address(), "RAY_AUTH_MODE": "token"}


def finished_run(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("job-test").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    steps = {h.step for h in client.get_metric_history(run.info.run_id, "train_loss")}
    assert steps == {2, 4}
    assert "val_loss" in run.data.metrics  # validation at the end
    return run


def test_pretrain_script_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "jobs/pretrain.py", *job_overrides(tmp_path, "script")], cwd=REPO,
                          env=env_without_ray_address(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "# resolved config" in out and "max_steps: 4" in out
    assert "started a local Ray cluster" in out
    assert "step 4/4 | loss" in out and "tok/s | ETA" in out  # the live progress line
    assert f"open the UI with:  mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in out
    assert "latest checkpoint: " + str(tmp_path / "ray_results" / "script" / "checkpoint_step_00000004") in out
    run = finished_run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert f"MLflow run:        {run.info.run_id}" in out
    # The streamed data's counts (documents read, dropped and altered by reason, tokens, blocks) are in MLflow.
    from mlflow.tracking import MlflowClient

    stats = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").download_artifacts(run.info.run_id, "data_stats.json")
    train = json.loads(Path(stats).read_text())["train"]
    assert train["documents_read"] > 0 and train["blocks"] >= 4 * 4 and "dropped" in train and "altered" in train
    assert train["document_tokens"] + train["eos_tokens"] >= train["blocks"] * (SEQ_LEN + 1)
    # Each worker streamed only its own file (one (file, row group) fragment), once: together the two workers read
    # the two files' rows once (every worker reading the whole stream would count each file twice). The files:
    # the first two of the corpus in the seeded order (shuffle_seed 0), computed here without importing ray (this
    # process must not import it before the ray_head fixture sets RAY_AUTH_MODE).
    import numpy as np
    import pyarrow.parquet as pq

    corpus = sorted((REPO / "outputs" / "corpus").glob("*.parquet"))
    files = [corpus[i] for i in np.random.default_rng(0).permutation(len(corpus))[:2]]
    assert train["fragments_read"] == 2
    assert train["documents_read"] + train["documents_other_split"] == sum(pq.ParquetFile(f).metadata.num_rows
                                                                          for f in files)
    # jobs/sample.py reads the run's latest checkpoint (written through DDP) and the config and tokenizer it names
    proc = subprocess.run([sys.executable, "jobs/sample.py", str(tmp_path / "ray_results" / "script"), "--prompt",
                           "The", "--max-new-tokens", "5", "--samples", "2", "--device", "cpu"], cwd=REPO,
                          env=env_without_ray_address(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model: {tmp_path / 'ray_results' / 'script' / 'checkpoint_step_00000004'}" in proc.stdout
    assert f"tokenizer: {REPO / 'outputs' / 'tokenizer' / 'tokenizer.json'}" in proc.stdout
    assert proc.stdout.count("--- sample ") == 2 and "--- sample 2 of 2 ---\nThe" in proc.stdout


def test_pretrain_script_refuses_a_bad_config_before_starting():
    proc = subprocess.run([sys.executable, "jobs/pretrain.py", "--set", "train.global_batch=7"], cwd=REPO,
                          env=env_without_ray_address(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config error" in proc.stderr and "train.global_batch: must be a multiple of" in proc.stderr
    assert "Ray" not in proc.stdout  # refused before any cluster was started


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head` on loopback with its own ports and temp dir, shared by this module's submissions;
    stopped (only it) at the end."""
    tmp_path = tmp_path_factory.mktemp("head")
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield from _ray_head(tmp_path, monkeypatch)


def _ray_head(tmp_path, monkeypatch):
    gcs, dash, client, agent_http, agent_grpc, metrics, node_mgr, obj_mgr, rt_env = free_ports(9)
    temp_dir = Path("/tmp") / f"rt-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths have a length limit
    cmd = ["ray", "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
           "--num-gpus=0", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
           f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
           f"--runtime-env-agent-port={rt_env}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log = (tmp_path / "ray-head.log").open("w")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # for this test's JobSubmissionClient
    head = subprocess.Popen(cmd, cwd=tmp_path, env=cluster_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group: we stop exactly this cluster
    address = f"http://127.0.0.1:{dash}"
    try:
        from ray.job_submission import JobSubmissionClient

        deadline = time.time() + 240
        while True:
            try:
                JobSubmissionClient(address).list_jobs()
                break
            except Exception:
                if head.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ray head did not come up: {(tmp_path / 'ray-head.log').read_text()[-3000:]}")
                time.sleep(2)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of this cluster is left, and only it
        except ProcessLookupError:
            pass
        log.close()


def wait_for_success(ray_head: str, submission_id: str, submit: subprocess.CompletedProcess) -> str:
    """Wait for a `ray job submit --no-wait` job to end; assert it succeeded; return its logs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert submit.returncode == 0, submit.stdout + submit.stderr
    client = JobSubmissionClient(ray_head)
    deadline = time.time() + 600
    while (status := client.get_job_status(submission_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                                    JobStatus.STOPPED}:
        assert time.time() < deadline, "job did not finish in time"
        time.sleep(3)
    logs = client.get_job_logs(submission_id)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    return logs


def test_ray_job_submit_runs_pretrain_on_a_started_head(ray_head, tmp_path):
    submission_id = f"pretrain-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", ray_head, "--submission-id", submission_id, "--no-wait",
         "--working-dir", ".", "--", "python", "jobs/pretrain.py", *job_overrides(tmp_path, "submitted")],
        cwd=REPO, env=cluster_env(), capture_output=True, text=True, timeout=300)
    logs = wait_for_success(ray_head, submission_id, submit)
    assert "joined Ray cluster" in logs and "step 4/4 | loss" in logs
    run = finished_run(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert run.data.params["train.run_name"] == "submitted"
    assert (tmp_path / "ray_results" / "submitted" / "checkpoint_step_00000004" / "train_state.pt").exists()


def test_ray_job_submit_runs_a_sweep_on_a_started_head(ray_head, tmp_path):
    """jobs/sweep.py under `ray job submit`: it joins the head, sizes its concurrency from a joined cluster, and
    leaves its MLflow parent and child runs where the (absolute) config paths say. One trial of 2 steps: the
    sweep's own logic is tested in tests/test_tune_sweep.py; this is the submission path only."""
    from mlflow.tracking import MlflowClient

    from test_tune_support import OVERRIDES

    sets = [*OVERRIDES, "tune.sel_block=[16]", "tune.n_selected=[4]", "tune.scheduler=fifo",
            "tune.token_budget=1024", "train.checkpoint_every=0",  # 1 trial of 2 steps
            "tune.name=submitted", f"tune.storage_path={tmp_path / 'ray'}",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"data.output_dir={REPO / 'outputs'}"]
    submission_id = f"sweep-{uuid.uuid4().hex[:8]}"
    submit = subprocess.run(
        ["ray", "job", "submit", "--address", ray_head, "--submission-id", submission_id, "--no-wait",
         "--working-dir", ".", "--", "python", "jobs/sweep.py", *(a for s in sets for a in ("--set", s))],
        cwd=REPO, env=cluster_env(), capture_output=True, text=True, timeout=300)
    logs = wait_for_success(ray_head, submission_id, submit)
    assert "sweep: joined the Ray cluster" in logs
    assert "1 trial(s) at a time: the joined cluster has 2 CPU now and a trial needs 1.1 CPU" in logs
    assert "sweep submitted: 1 trials, 0 settings refused" in logs
    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = mlflow.get_run(json.loads((tmp_path / "ray" / "submitted" / "mlflow_run.json").read_text())["run_id"])
    assert parent.info.status == "FINISHED" and f"MLflow parent run: {parent.info.run_id}" in logs
    assert {a.path for a in mlflow.list_artifacts(parent.info.run_id)} >= {"summary.csv", "pareto.png"}
    (child,) = mlflow.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert (child.data.params["nsa.sel_block"], child.data.params["nsa.n_selected"], child.info.status) == (
        "16", "4", "FINISHED")
    assert {m.step for m in mlflow.get_metric_history(child.info.run_id, "train_loss")} == {1, 2}
