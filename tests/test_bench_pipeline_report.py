"""bench/train_pipeline_report.py: issue 9's pipeline numbers read back from a real MLflow file store."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "train_pipeline_report", Path(__file__).resolve().parent.parent / "bench" / "train_pipeline_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def log_run(client, exp_id, name, reports):
    """One FINISHED run of `name` with rank 0's interval reports (step -> metrics), as the training loop logs."""
    run = client.create_run(exp_id, run_name=name)
    for step, metrics in reports.items():
        for key, value in metrics.items():
            client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id)


def interval(step_time_s, tokens_per_step, wait_s, loss):
    return {"tokens_per_s": tokens_per_step / step_time_s, "step_time_s": step_time_s, "data_wait_s": wait_s,
            "train_loss": loss, "mfu": 0.3, "peak_mem_mb": 1000.0}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    mlruns = tmp_path / "mlruns"
    client = MlflowClient(f"file:{mlruns}")
    exp_id = client.create_experiment("nsa-issue9")
    tokens = 5 * 1000  # 5 steps of 1000 tokens per report
    # 2 GPUs: a slow first report after each start (compile), then 0.5 s steps; stopped after 10, resumed to 20.
    two = {5: interval(9.0, tokens, 0.0, 3.0), 10: interval(0.5, tokens, 0.01, 2.5),
           15: interval(7.0, tokens, 0.0, 2.4), 20: interval(0.5, tokens, 0.01, 2.2)}
    # 1 GPU: 0.9 s steps after its first report
    one = {5: interval(8.0, tokens, 0.0, 3.1), 10: interval(0.9, tokens, 0.009, 2.6),
           15: interval(0.9, tokens, 0.009, 2.45), 20: interval(0.9, tokens, 0.009, 2.25)}
    log_run(client, exp_id, "nsa-2gpu", two)
    log_run(client, exp_id, "nsa-1gpu", one)
    return mlruns, client, exp_id


def run_report(mlruns, out, tag):
    assert report.main(["--mlruns", str(mlruns), "--device", "test", "--commit", "abc", "--resume-step", "10",
                        "--skip", "1", "--out", str(out), f"--tag={tag}"]) in (0, None)
    return json.loads(next(out.glob(f"*{tag}.json")).read_text())


def test_scaling_data_wait_and_resume_from_the_steady_reports(store, tmp_path):
    mlruns, _, _ = store
    result = run_report(mlruns, tmp_path / "out", "-t1")
    # Steady reports: the first after each start is left out (step 5 of both, and step 15 of the resumed 2-GPU run).
    assert result["scaling_efficiency"] == pytest.approx((1000 / 0.5) / (2 * 1000 / 0.9))
    assert result["data_wait_share_2gpu"] == pytest.approx(0.01 / 0.5)
    assert result["resume"]["continued"] is True
    assert result["resume"]["max_train_loss_gap_vs_1gpu"] == pytest.approx(0.1)
    md = next((tmp_path / "out").glob("*-t1.md")).read_text()
    assert "**0.900**" in md and "target >= 0.9: met" in md and "another order" in md
    # No dense run: no quality plot (it would compare NSA with itself under a "vs dense" title).
    assert not list((tmp_path / "out").glob("*.png"))


def test_the_quality_plot_needs_the_dense_run(store, tmp_path):
    mlruns, client, exp_id = store
    log_run(client, exp_id, "dense-1gpu", {10: {**interval(0.8, 5000, 0.0, 2.5), "val_loss": 2.7},
                                           20: {**interval(0.8, 5000, 0.0, 2.2), "val_loss": 2.4}})
    run_report(mlruns, tmp_path / "out", "-t2")
    assert [p.name[-16:] for p in (tmp_path / "out").glob("*.png")] == ["-t2-val-loss.png"]


def test_the_report_opens_the_file_store_without_the_callers_opt_in(store, tmp_path):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set; the GPU scripts export it for their runs,
    but the report is run after them from a plain shell (stop 68's call lost its report so). In a fresh process:
    this one's MLflow caches the store the fixture opened, which would hide a missing opt-in."""
    mlruns, _, _ = store
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}
    script = Path(__file__).resolve().parent.parent / "bench" / "train_pipeline_report.py"
    done = subprocess.run([sys.executable, str(script), "--mlruns", str(mlruns), "--device", "test", "--commit",
                           "abc", "--resume-step", "10", "--skip", "1", "--out", str(tmp_path / "out"), "--tag=-t3"],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "out").glob("*-t3.json"))


def test_too_few_reports_for_the_skip_is_a_clear_error(store, tmp_path):
    mlruns, _, _ = store
    with pytest.raises(SystemExit, match="leaves none to measure"):
        report.main(["--mlruns", str(mlruns), "--device", "test", "--commit", "abc", "--resume-step", "10",
                     "--skip", "2", "--out", str(tmp_path / "out")])
