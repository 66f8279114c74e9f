"""MLflow tracking: one MLflow run per training run, the same run across restarts.

The driver opens (or reopens) the run before any worker starts: its id is persisted as
`<storage_path>/<run name>/mlflow_run.json`, next to Ray Train's own state, so rerunning the same run name
(resume) or a Ray Train worker restart logs into the same MLflow run. Rank 0 logs metrics with their step,
system metrics, checkpoints (optionally) and the final model. The tracking URI comes from the config; when it
is unset, from MLFLOW_TRACKING_URI; else the local sqlite store `sqlite:///<output_dir>/mlflow.db` with artifacts
under `<output_dir>/mlartifacts`. For a team, point tracking_uri at a shared `mlflow server`
(Postgres backend store plus an object store for artifacts, see docs/runbook.md): nothing else changes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run.json"


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else sqlite:///<data.output_dir>/mlflow.db
    experiment: str = "nsa-pretrain"
    run_name: str | None = None  # MLflow run name; None means train.run_name
    parent_run_id: str | None = None  # makes this run a child run (a Tune trial under its sweep's run)
    tags: dict[str, str] = field(default_factory=dict)
    system_metrics: bool = True  # CPU/memory/disk/network (and GPU when pynvml is present)
    system_metrics_interval_s: float = 10.0
    log_checkpoints: bool = False  # also copy each checkpoint into the run's artifacts (small models only)
    registered_model_name: str | None = "nsa-tiny"  # final model registered under this name; None: log only

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"tracking.{name}: {why}")

        for name in ("enabled", "system_metrics", "log_checkpoints"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("tracking_uri", "run_name", "parent_run_id", "registered_model_name"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, str) and v != ""), name, f"must be None or a non-empty string, got {v!r}")
        require(isinstance(self.system_metrics_interval_s, (int, float)) and self.system_metrics_interval_s > 0,
                "system_metrics_interval_s", f"must be positive, got {self.system_metrics_interval_s!r}")
        require(isinstance(self.experiment, str) and self.experiment != "", "experiment",
                f"must be a non-empty string, got {self.experiment!r}")
        require(isinstance(self.tags, dict) and all(isinstance(k, str) for k in self.tags), "tags",
                f"must be a mapping of string keys, got {self.tags!r}")
        object.__setattr__(self, "tags", {k: str(v) for k, v in self.tags.items()})


def resolve_tracking_uri(cfg: TrackingConfig, output_dir: str) -> str:
    """The URI this run logs to (an absolute sqlite path when it defaults to the local store)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def default_artifact_location(tracking_uri: str, output_dir: str) -> str | None:
    """Artifacts of the default local store go to <output_dir>/mlartifacts; a server decides its own."""
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        return (Path(output_dir).resolve() / "mlartifacts").as_uri()
    return None


def ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


# --- persisted run id (local folder or pyarrow URI) -------------------------------------------------------------

def _run_id_path(run_dir: str) -> str:
    return run_dir.rstrip("/") + "/" + RUN_ID_FILE


def _read_text(uri: str) -> str | None:
    if "://" not in uri:
        p = Path(uri)
        return p.read_text() if p.exists() else None
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def _write_text(uri: str, text: str) -> None:
    if "://" not in uri:
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(uri).with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(uri)  # atomic: a crash never leaves half a run id behind
        return
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


# --- driver side ------------------------------------------------------------------------------------------------

def open_run(cfg: TrackingConfig, *, tracking_uri: str, artifact_location: str | None, run_dir: str,
             default_run_name: str, params: dict[str, Any], artifacts: dict[str, str]) -> str:
    """Create the MLflow run of this training run, or reopen the one persisted in run_dir. Returns its id.

    params: flat resolved config (logged once, when the run is created); artifacts: {artifact dir: local file}.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    saved = _read_text(_run_id_path(run_dir))
    if saved is not None:
        record = json.loads(saved)
        run = client.get_run(record["run_id"])  # raises if the run was deleted: never silently start a new one
        if record.get("tracking_uri") != tracking_uri:
            raise ValueError(f"{_run_id_path(run_dir)} belongs to tracking URI {record.get('tracking_uri')!r}, "
                             f"not {tracking_uri!r}; use a new train.run_name or the original tracking URI")
        client.update_run(run.info.run_id, status="RUNNING")
        log.info("resuming MLflow run %s", run.info.run_id)
        return run.info.run_id

    experiment = client.get_experiment_by_name(cfg.experiment)
    experiment_id = (experiment.experiment_id if experiment is not None
                     else client.create_experiment(cfg.experiment, artifact_location=artifact_location))
    tags = dict(cfg.tags)
    tags["ray_train_run_dir"] = run_dir
    if cfg.parent_run_id:
        tags["mlflow.parentRunId"] = cfg.parent_run_id
    run = client.create_run(experiment_id, run_name=cfg.run_name or default_run_name, tags=tags)
    run_id = run.info.run_id
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[i:i + 100])
    for artifact_path, local in artifacts.items():
        client.log_artifact(run_id, local, artifact_path=artifact_path)
    _write_text(_run_id_path(run_dir), json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}))
    return run_id


def close_run(tracking_uri: str, run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_terminated(run_id, status=status)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the resolved config as MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# --- worker side (rank 0) ---------------------------------------------------------------------------------------

STEP_METRIC = "train_loss"  # logged at every logging step: its history says how far the run's log got


class RunLogger:
    """Rank 0's handle on the run: metrics with their step, system metrics, checkpoints, the final model.

    Each step is logged once. A resumed run (a restarted worker, a rerun of the same run name, a restored sweep
    trial) replays the steps between its checkpoint and where the lost attempt got; those steps are already in
    the run's history, so they are not logged again (MLflow's charts would otherwise draw the replayed stretch
    twice). The resume itself is logged as `resumed_from_step`.
    """

    def __init__(self, cfg: TrackingConfig, tracking_uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.cfg, self.tracking_uri, self.run_id = cfg, tracking_uri, run_id
        self.client = MlflowClient(tracking_uri)
        history = self.client.get_metric_history(run_id, STEP_METRIC)
        self.logged_through = max((m.step for m in history), default=0)
        self._monitor = None
        if cfg.system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_interval_s,
                                                 resume_logging=True, tracking_uri=tracking_uri)
            self._monitor.start()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one step's metrics; a step the run's history already holds (a replayed one) is skipped."""
        if step <= self.logged_through:
            return
        self._log_batch(metrics, step)
        if STEP_METRIC in metrics:
            self.logged_through = step

    def log_resume(self, step: int) -> None:
        """The run went on from its checkpoint at `step` (one point per resume, so repeated resumes all show)."""
        self._log_batch({"resumed_from_step": step}, step)

    def _log_batch(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_checkpoint(self, local_dir: str, step: int) -> None:
        if self.cfg.log_checkpoints:
            self.client.log_artifacts(self.run_id, local_dir, artifact_path=f"checkpoints/step_{step:08d}")

    def log_final_model(self, model_dir: str) -> str | None:
        """Log the final weights and config as the run's `model` artifact; register it when configured.

        Returns the registered model version, or None when no registry name is configured.
        """
        self.client.log_artifacts(self.run_id, model_dir, artifact_path="model")
        name = self.cfg.registered_model_name
        if name is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                raise
        # A version pointing at the logged weights (state dict + config: no pickled classes to import).
        source = self.client.get_run(self.run_id).info.artifact_uri.rstrip("/") + "/model"
        version = self.client.create_model_version(name, source=source, run_id=self.run_id)
        return str(version.version)

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None
