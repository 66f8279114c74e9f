"""Ray Tune sweeps of NSA's block sizes against throughput and validation loss (issue 7).

Read top to bottom:
  1. TuneConfig: what to sweep and how (the `tune:` section of a job YAML), validated when built.
  2. The search space: every combination of the swept NSA fields, with the ones NSAConfig refuses filtered
     out before launch (each with a logged reason), so that no trial ever crashes on an invalid config.
  3. One trial: a Tune function trainable that launches a Ray Train TorchTrainer (build_trainer) whose
     RunConfig is named by the trial id; a report callback forwards its validation reports to Tune.
  4. The sweep: Tuner (or Tuner.restore for an interrupted sweep) with ASHA on validation loss, one MLflow
     parent run, the trials as its child runs, and a summary table plus a Pareto-front plot of throughput
     against validation loss logged to the parent run.

Metrics of a trial: `tokens_per_s` is the median of the trainer's reported tokens/s over the reports after
`throughput_warmup_steps` (so compile and warmup are excluded), `val_loss` the last validation loss,
`peak_mem_mb` the largest reported peak memory, `startup_s` the trial's seconds from its trainer's launch to the end
of its second step (pipeline/train/loop.py's Startup: workers, data, compilation, CUDA graphs).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nsa_model.config import ModelConfig
from pipeline.ray_cluster import init_ray as _init_ray

log = logging.getLogger(__name__)

SearchKind = Literal["grid", "random"]
SchedulerKind = Literal["asha", "fifo"]

# The NSAConfig fields a sweep may vary, in the order they appear in tables.
SWEPT_FIELDS = ("sel_block", "n_selected", "cmp_block", "cmp_stride", "window")

# Columns of the summary table, in order.
SUMMARY_COLUMNS = ("trial_id", *SWEPT_FIELDS, "init_seed", "status", "step", "tokens_seen", "tokens_per_s", "val_loss",
                   "peak_mem_mb", "startup_s", "pareto", "mlflow_run_id")


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")


def _int_list(value: Any, name: str, *, allow_none: bool) -> tuple[int, ...] | None:
    if value is None:
        _require(allow_none, name, "must be a non-empty list of positive ints, got None")
        return None
    _require(isinstance(value, (list, tuple)) and len(value) > 0, name,
             f"must be a non-empty list of positive ints, got {value!r}")
    for v in value:
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                 f"must hold positive ints only, got {v!r} in {list(value)}")
    _require(len(set(value)) == len(value), name, f"has duplicates: {list(value)}")
    return tuple(value)


@dataclass(frozen=True)
class TuneConfig:
    """The `tune:` section of a job config: the sweep over NSA settings and how trials are run."""

    name: str = "nsa-sweep"  # the Tune experiment; rerunning with the same name resumes it
    storage_path: str = "outputs/ray_results"  # Tune's storage; trials' Train runs go under <name>/trials/
    search: SearchKind = "grid"  # grid: every valid combination; random: num_samples draws among them
    num_samples: int = 1  # grid: repeats of the whole grid; random: number of trials
    seed: int = 0  # random search's seed
    # Values to sweep; None keeps the model preset's value.
    sel_block: tuple[int, ...] | None = (16, 32)  # l'
    n_selected: tuple[int, ...] | None = (4, 8)  # n
    cmp_block: tuple[int, ...] | None = None  # l
    cmp_stride: tuple[int, ...] | None = None  # d
    window: tuple[int, ...] | None = None  # w
    # Model-initialization seeds (train.seed): each setting runs once per seed, so that a setting's spread of losses
    # over seeds can be read against the differences between settings (the front is drawn on each setting's mean).
    # None: train.seed alone.
    init_seeds: tuple[int, ...] | None = None
    token_budget: int = 65536  # training tokens of every trial (sets train.max_steps)
    throughput_warmup_steps: int = 2  # reports at or before this step are left out of tokens/s
    scheduler: SchedulerKind = "asha"  # asha stops trials whose validation loss lags; fifo runs all to the end
    grace_period: int = 8  # optimizer steps every trial runs before ASHA may stop it
    reduction_factor: int = 2  # ASHA keeps 1/reduction_factor of the trials at each rung
    max_concurrent_trials: int | None = None  # None: derived from the cluster (see trial_concurrency)
    trial_driver_cpus: float = 0.1  # CPU of each trial's driver (it only waits on its TorchTrainer)
    data_cpus_per_trial: float = 0.5  # CPU left free per trial for its Ray Data reads (else they starve)
    # Tokenize and pack the data once, before the trials, when data.packed_dir is unset: every trial then
    # reads the same prepared blocks instead of re-tokenizing, which would also skew its tokens/s.
    prepare_data: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name.strip() != "" and "/" not in self.name,
                 "TuneConfig.name", f"must be a non-empty name without '/', got {self.name!r}")
        _require(isinstance(self.storage_path, str) and self.storage_path != "", "TuneConfig.storage_path",
                 f"must be a non-empty path or URI, got {self.storage_path!r}")
        _require(self.search in ("grid", "random"), "TuneConfig.search",
                 f"must be 'grid' or 'random', got {self.search!r}")
        _require(self.scheduler in ("asha", "fifo"), "TuneConfig.scheduler",
                 f"must be 'asha' or 'fifo', got {self.scheduler!r}")
        for name in SWEPT_FIELDS:
            object.__setattr__(self, name, _int_list(getattr(self, name), f"TuneConfig.{name}", allow_none=True))
        if self.init_seeds is not None:
            _require(isinstance(self.init_seeds, (list, tuple)) and len(self.init_seeds) > 0
                     and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in self.init_seeds)
                     and len(set(self.init_seeds)) == len(self.init_seeds), "TuneConfig.init_seeds",
                     f"must be None or a non-empty list of distinct ints >= 0, got {self.init_seeds!r}")
            object.__setattr__(self, "init_seeds", tuple(self.init_seeds))
        _require(any(getattr(self, f) is not None for f in SWEPT_FIELDS), "TuneConfig",
                 f"sweeps nothing: give values for at least one of {list(SWEPT_FIELDS)}")
        for name in ("num_samples", "token_budget", "grace_period", "reduction_factor"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, f"TuneConfig.{name}",
                     f"must be a positive int, got {value!r}")
        _require(isinstance(self.seed, int), "TuneConfig.seed", f"must be an int, got {self.seed!r}")
        _require(isinstance(self.throughput_warmup_steps, int) and self.throughput_warmup_steps >= 0,
                 "TuneConfig.throughput_warmup_steps", f"must be an int >= 0, got {self.throughput_warmup_steps!r}")
        _require(self.reduction_factor >= 2, "TuneConfig.reduction_factor",
                 f"must be >= 2, got {self.reduction_factor}")
        _require(self.max_concurrent_trials is None
                 or (isinstance(self.max_concurrent_trials, int) and self.max_concurrent_trials > 0),
                 "TuneConfig.max_concurrent_trials", f"must be None or a positive int, got {self.max_concurrent_trials!r}")
        _require(isinstance(self.data_cpus_per_trial, (int, float)) and self.data_cpus_per_trial >= 0,
                 "TuneConfig.data_cpus_per_trial", f"must be >= 0, got {self.data_cpus_per_trial!r}")
        _require(isinstance(self.prepare_data, bool), "TuneConfig.prepare_data",
                 f"must be a bool, got {self.prepare_data!r}")
        _require(isinstance(self.trial_driver_cpus, (int, float)) and 0 < self.trial_driver_cpus <= 1,
                 "TuneConfig.trial_driver_cpus", f"must be in (0, 1], got {self.trial_driver_cpus!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _require(not unknown, "TuneConfig", f"unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# ----------------------------------------------------------------------------------------------------------
# The search space


@dataclass(frozen=True)
class RejectedSetting:
    """A combination of swept values that NSAConfig (or the model) refuses, and why."""

    setting: dict[str, int]
    reason: str


def candidate_settings(tune_cfg: TuneConfig) -> list[dict[str, int]]:
    """Every combination of the swept values (the cross product), in a stable order."""
    fields = [f for f in SWEPT_FIELDS if getattr(tune_cfg, f) is not None]
    return [dict(zip(fields, values)) for values in itertools.product(*(getattr(tune_cfg, f) for f in fields))]


def apply_setting(model: ModelConfig, setting: dict[str, int]) -> ModelConfig:
    """The model with the setting's NSA fields replaced; raises ValueError if NSAConfig refuses them."""
    nsa = dataclasses.replace(model.nsa, **setting)  # NSAConfig.__post_init__ validates
    return model.replace(nsa=nsa)


def split_valid(settings: list[dict[str, int]], model: ModelConfig) -> tuple[list[dict[str, int]], list[RejectedSetting]]:
    """Separate the settings NSA can run from those it refuses; every refusal is logged with its reason."""
    valid, rejected = [], []
    for setting in settings:
        try:
            apply_setting(model, setting)
        except ValueError as err:
            rejected.append(RejectedSetting(setting, str(err)))
            log.warning("sweep: skipping %s: %s", _describe(setting), err)
        else:
            valid.append(setting)
    return valid, rejected


def full_setting(model: ModelConfig, setting: dict[str, int]) -> dict[str, int]:
    """All swept fields of a trial (the model's own values where the sweep leaves a field alone)."""
    nsa = apply_setting(model, setting).nsa
    return {f: getattr(nsa, f) for f in SWEPT_FIELDS}


def _describe(setting: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


# ----------------------------------------------------------------------------------------------------------
# Results: steady-state throughput, the Pareto front, the summary table and plot


class ThroughputTracker:
    """Accumulates a trial's reports into its summary metrics.

    tokens/s is the median over the reports after `warmup_steps`: the first steps pay for compilation, caches
    and worker start, and a median also ignores a report slowed by a validation pass or a checkpoint.
    """

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps
        self.steady_tokens_per_s: list[float] = []
        self.peak_mem_mb = float("nan")
        self.startup_s = float("nan")

    def add(self, metrics: dict[str, Any]) -> None:
        step = metrics.get("step")
        tps = metrics.get("tokens_per_s")
        if step is not None and tps is not None and step > self.warmup_steps and math.isfinite(tps):
            self.steady_tokens_per_s.append(float(tps))
        mem = metrics.get("peak_mem_mb")
        if mem is not None and math.isfinite(mem):
            self.peak_mem_mb = mem if math.isnan(self.peak_mem_mb) else max(self.peak_mem_mb, mem)
        if "startup_total_s" in metrics:  # reported once per run
            self.startup_s = float(metrics["startup_total_s"])

    def tokens_per_s(self) -> float:
        return statistics.median(self.steady_tokens_per_s) if self.steady_tokens_per_s else float("nan")


def pareto_front(tokens_per_s: list[float], val_loss: list[float]) -> list[bool]:
    """Which points no other point dominates (higher-or-equal throughput and lower-or-equal loss, one strictly).

    Points with a missing (NaN) coordinate are never on the front and never dominate.
    """
    _require(len(tokens_per_s) == len(val_loss), "pareto_front",
             f"got {len(tokens_per_s)} throughputs and {len(val_loss)} losses")
    finite = [math.isfinite(t) and math.isfinite(v) for t, v in zip(tokens_per_s, val_loss)]
    front = []
    for i, (t_i, v_i) in enumerate(zip(tokens_per_s, val_loss)):
        dominated = any(
            finite[j] and tokens_per_s[j] >= t_i and val_loss[j] <= v_i
            and (tokens_per_s[j] > t_i or val_loss[j] < v_i)
            for j in range(len(val_loss)) if j != i
        )
        front.append(finite[i] and not dominated)
    return front


def write_summary_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in SUMMARY_COLUMNS})


def format_summary(rows: list[dict[str, Any]]) -> str:
    """The summary as an aligned text table for the terminal."""
    columns = [c for c in SUMMARY_COLUMNS if c != "mlflow_run_id"]

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        if isinstance(value, bool):
            return "*" if value else ""
        return str(value)

    table = [columns] + [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table)


def _setting_key(row: dict[str, Any]) -> tuple[int, ...]:
    """A trial's (or a setting's) swept values, in SWEPT_FIELDS order."""
    return tuple(row[f] for f in SWEPT_FIELDS)


def by_setting(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per NSA setting over its trials (one per init seed): mean tokens/s, mean and range of validation
    loss, and whether every trial trained the whole budget (status DONE). Means are NaN if any trial lacks the value.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_setting_key(r), []).append(r)
    out = []
    for key, trials in groups.items():
        losses = [t["val_loss"] for t in trials]
        out.append({**dict(zip(SWEPT_FIELDS, key)), "trials": len(trials),
                    "complete": all(t.get("status", "DONE") == "DONE" for t in trials),
                    "step": min(t.get("step", 0) for t in trials),
                    "tokens_per_s": statistics.fmean(t["tokens_per_s"] for t in trials),
                    "val_loss": statistics.fmean(losses),
                    "val_loss_min": min(losses), "val_loss_max": max(losses)})
    return out


def plot_pareto(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Throughput against validation loss, one point per setting (the mean over its seeds, the range of its losses
    as a bar where it has several), the Pareto front joined by a line (matplotlib, no display needed).

    Settings with a trial that ASHA stopped early are drawn hollow with the step it reached: their loss is from
    fewer tokens.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    front_keys = {_setting_key(r) for r in rows if r.get("pareto")}
    points = sorted((s for s in by_setting(rows) if math.isfinite(s["tokens_per_s"]) and math.isfinite(s["val_loss"])),
                    key=lambda s: (s["tokens_per_s"], s["val_loss"]))
    for i, s in enumerate(points):
        on_front = _setting_key(s) in front_keys
        color = "tab:red" if on_front else "tab:gray"
        if s["trials"] > 1:
            ax.errorbar(s["tokens_per_s"], s["val_loss"], color=color, zorder=2,
                        yerr=[[s["val_loss"] - s["val_loss_min"]], [s["val_loss_max"] - s["val_loss"]]], capsize=3)
        ax.scatter(s["tokens_per_s"], s["val_loss"], zorder=3, edgecolors=color,
                   facecolors=color if s["complete"] else "none")
        label = (f"l'={s['sel_block']} n={s['n_selected']}" + (f" ({s['trials']} seeds)" if s["trials"] > 1 else "")
                 + ("" if s["complete"] else f" (stopped at step {s['step']})"))
        # Labels alternate above and below their points: neighbours in throughput often share a loss.
        ax.annotate(label, (s["tokens_per_s"], s["val_loss"]), textcoords="offset points",
                    xytext=(5, 6 if i % 2 == 0 else -13), fontsize=8)
    front = [s for s in points if _setting_key(s) in front_keys]
    if front:
        ax.plot([s["tokens_per_s"] for s in front], [s["val_loss"] for s in front], color="tab:red",
                label="Pareto front (settings that trained the whole budget)", zorder=2)
        ax.legend()
    ax.set_xlabel("steady-state training throughput (tokens/s)")
    ax.set_ylabel("validation loss" + (" (mean over seeds; bars: their range)" if any(
        s["trials"] > 1 for s in points) else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with their Pareto flag set, sorted by validation loss (trials without one last).

    The front is over settings, on each setting's mean over its seeds (by_setting), and a trial is flagged when its
    setting is on it. Only settings whose every trial trained the whole token budget (status DONE) take part: a trial
    ASHA stopped early has a loss from fewer tokens, which is not comparable.
    """
    settings = by_setting(rows)
    front = pareto_front([s["tokens_per_s"] if s["complete"] else math.nan for s in settings],
                         [s["val_loss"] if s["complete"] else math.nan for s in settings])
    on_front = {_setting_key(s) for s, p in zip(settings, front) if p}
    rows = [{**r, "pareto": _setting_key(r) in on_front} for r in rows]
    return sorted(rows, key=lambda r: (not math.isfinite(r["val_loss"]), r["val_loss"], r["trial_id"]))


# ----------------------------------------------------------------------------------------------------------
# One trial: a Tune function trainable that runs a Ray Train TorchTrainer


def _is_local(path: str) -> bool:
    return "://" not in path


def _absolute(path: str) -> str:
    return str(Path(path).resolve()) if _is_local(path) else path


def steps_for_budget(job, token_budget: int) -> int:
    """Optimizer steps that train on at least token_budget tokens (a step trains global_batch * seq_len)."""
    tokens_per_step = job.train.global_batch * job.data.seq_len
    return -(-token_budget // tokens_per_step)


@dataclass(frozen=True)
class SweepPlan:
    """What every trial of a sweep shares; shipped to the trials through tune.with_parameters."""

    job: Any  # pipeline.config.JobConfig of the sweep (paths absolute), before any trial's changes
    tune: TuneConfig
    max_steps: int  # from the token budget
    experiment_dir: str  # <tune.storage_path>/<tune.name>
    parent_run_id: str  # MLflow run of the sweep

    @property
    def trials_storage(self) -> str:
        """Where the trials' Ray Train runs (checkpoints, MLflow run ids) live: one folder per trial id."""
        return self.experiment_dir.rstrip("/") + "/trials"

    def trial_job(self, setting: dict[str, int], trial_id: str, init_seed: int | None = None):
        """The job of one trial: the sweep's job with the trial's NSA fields, model-initialization seed (None: the
        job's own), budget, run name and MLflow parent."""
        job = self.job
        train = dataclasses.replace(job.train, run_name=trial_id, storage_path=self.trials_storage,
                                    max_steps=self.max_steps, warmup_steps=min(job.train.warmup_steps, self.max_steps),
                                    seed=job.train.seed if init_seed is None else init_seed)
        tags = {**job.tracking.tags, "sweep": self.tune.name, "trial_id": trial_id}
        tracking = dataclasses.replace(job.tracking, run_name=f"{self.tune.name}/{trial_id}",
                                       parent_run_id=self.parent_run_id, tags=tags,
                                       registered_model_name=None)  # a sweep registers no model versions
        return job.replace(model=apply_setting(job.model, setting), train=train, tracking=tracking)


def _validation_report_callback(warmup_steps: int):
    """A TuneReportCallback that forwards only reports carrying val_loss, with the trial's running summary.

    Tune's ASHA decides on val_loss, and Tune refuses a result without the metric it schedules on; the trainer
    reports val_loss only when it validated, so the other reports feed the throughput summary here instead.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class ValidationReportCallback(TuneReportCallback):
        def __init__(self):
            super().__init__()
            self.tracker = ThroughputTracker(warmup_steps)

        def after_report(self, run_context, metrics, checkpoint):
            rank0 = metrics[0]
            self.tracker.add(rank0)
            if rank0.get("val_loss") is None:
                return
            forwarded = {k: rank0[k] for k in ("step", "tokens_seen", "train_loss", "val_loss", "lr") if k in rank0}
            forwarded["tokens_per_s"] = self.tracker.tokens_per_s()
            forwarded["peak_mem_mb"] = self.tracker.peak_mem_mb
            forwarded["startup_s"] = self.tracker.startup_s
            super().after_report(run_context, [forwarded], checkpoint)

    return ValidationReportCallback()


def run_trial(config: dict[str, Any], plan: SweepPlan) -> None:
    """Tune's function trainable: one TorchTrainer run with this trial's NSA setting."""
    import ray.data
    import ray.train
    from ray import tune

    from pipeline.tracking import close_run
    from pipeline.train.trainer import build_trainer

    trial_id = tune.get_context().get_trial_id()
    job = plan.trial_job(config["nsa"], trial_id, config.get("init_seed"))
    # Trials print their training lines and Tune its status table; Ray Data's per-epoch progress bars from every
    # trial would bury both.
    ray.data.DataContext.get_current().enable_progress_bars = False
    run_config = ray.train.RunConfig(
        name=trial_id, storage_path=plan.trials_storage,
        callbacks=[_validation_report_callback(plan.tune.throughput_warmup_steps)],
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.train.keep_checkpoints),
        failure_config=ray.train.FailureConfig(max_failures=job.train.max_failures),
    )
    trainer = build_trainer(job, run_config=run_config)
    run_id, tracking_uri = trainer.nsa_mlflow  # the trial's MLflow child run, opened by build_trainer
    try:
        trainer.fit()
    except BaseException:
        if run_id is not None:
            close_run(tracking_uri, run_id, "FAILED")
        raise
    if run_id is not None:
        close_run(tracking_uri, run_id, "FINISHED")


# ----------------------------------------------------------------------------------------------------------
# The sweep


SWEEP_CONFIG_FILE = "sweep_config.json"  # the sweep's tune config and budget, compared on resume


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]  # the summary table, best validation loss first
    rejected: list[RejectedSetting]
    experiment_dir: str
    tracking_uri: str
    parent_run_id: str
    summary_csv: Path
    pareto_png: Path


def trial_dirname(trial) -> str:
    """Tune's folder of a trial is its id, the same name as its Ray Train run."""
    return trial.trial_id


def trial_name(trial) -> str:
    """What Tune's status table and logs call a trial: its id, NSA setting (the table cuts a dict short) and, in a
    sweep over init seeds, its seed."""
    seed = trial.config.get("init_seed")
    return f"{trial.trial_id} {_describe(trial.config['nsa'])}" + ("" if seed is None else f", init_seed={seed}")


def plan_settings(job) -> tuple[list[dict[str, int]], list[RejectedSetting]]:
    """The settings to launch and the ones refused, each refusal logged: NSAConfig's rules, then preflight."""
    from pipeline.config import preflight
    from pipeline.data.tokenizer import load_tokenizer

    valid, rejected = split_valid(candidate_settings(job.tune), job.model)
    vocab_size = load_tokenizer(job.data).vocab_size  # also builds the embedded tokenizer once, before any trial
    launchable = []
    for setting in valid:
        try:
            preflight(job.replace(model=apply_setting(job.model, setting)), tokenizer_vocab_size=vocab_size)
        except ValueError as err:
            rejected.append(RejectedSetting(setting, str(err)))
            log.warning("sweep: skipping %s: %s", _describe(setting), err)
        else:
            launchable.append(setting)
    return launchable, rejected


def check_sweep(job, settings: list[dict[str, int]], max_steps: int) -> None:
    """Refuse, before anything starts, a sweep that cannot produce what it is for."""
    tune_cfg: TuneConfig = job.tune
    _require(len(settings) > 0, "tune", "no valid combination of the swept NSA values is left to run "
             "(see the 'skipping' warnings above for why each was refused)")
    _require(job.train.val_every > 0, "train.val_every",
             "must be > 0 in a sweep: trials are compared and scheduled on validation loss")
    _require(max_steps > tune_cfg.throughput_warmup_steps, "tune.token_budget",
             f"gives {max_steps} steps, not more than throughput_warmup_steps={tune_cfg.throughput_warmup_steps}: "
             "no step would be measured")
    if tune_cfg.scheduler == "asha":
        _require(tune_cfg.grace_period < max_steps, "tune.grace_period",
                 f"must be < the trial's {max_steps} steps (from token_budget), or ASHA never stops a trial; "
                 f"got {tune_cfg.grace_period} (use scheduler: fifo to run every trial to the end)")
        _require(job.train.val_every <= tune_cfg.grace_period, "train.val_every",
                 f"must be <= tune.grace_period ({job.train.val_every} > {tune_cfg.grace_period}): ASHA decides "
                 "on validation losses, so a trial must validate before its grace period ends")


# What makes two runs of a sweep the same experiment (how many trials run side by side may change on resume).
_EXPERIMENT_FIELDS = ("search", "num_samples", "seed", "init_seeds", "token_budget", "throughput_warmup_steps",
                      "scheduler", "grace_period", "reduction_factor")


def sweep_record(job, settings: list[dict[str, int]], max_steps: int) -> dict[str, Any]:
    """The sweep as an experiment: its settings, budget, scheduling, and the model and training they vary."""
    train = {k: v for k, v in dataclasses.asdict(job.train).items() if k not in ("run_name", "storage_path")}
    return json.loads(json.dumps({
        "settings": settings, "max_steps": max_steps, **{f: getattr(job.tune, f) for f in _EXPERIMENT_FIELDS},
        "model": job.model.to_dict(), "train": train, "data": job.data.to_dict()}, default=str))


def _check_same_sweep(experiment_dir: str, record: dict[str, Any]) -> None:
    """Resuming with a changed sweep would silently mix two experiments: refuse it."""
    path = Path(experiment_dir) / SWEEP_CONFIG_FILE
    if not _is_local(experiment_dir):
        return  # the MLflow parent run's params hold the original config; Tune restores its own space
    if path.exists():
        saved = json.loads(path.read_text())
        _require(saved == record, "tune.name",
                 f"{experiment_dir} holds a sweep with a different config; use a new tune.name to start another "
                 f"sweep (saved: {saved}, now: {record})")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))


@dataclass(frozen=True)
class ClusterView:
    """What a sweep can know about the cluster's size when it starts."""

    fixed_size: bool  # a local cluster this process started itself: what it has now is all it will ever have
    now: dict[str, float]  # ray.cluster_resources() at the start
    max: dict[str, float] | None  # the most the autoscaler may grow it to, where the autoscaler reports it


def cluster_view() -> ClusterView:
    """The running cluster, seen as trainer._cluster_gpus() sees it: only a cluster this process started is fixed
    in size; one it joined (ray job submit, RAY_ADDRESS) may autoscale from zero worker nodes."""
    import ray

    node = ray._private.worker._global_node  # the Node this driver started, or the one it connected to
    fixed = node is not None and node.head
    # The autoscaler's configured maximum (what Ray Train itself checks before it waits for workers); None where
    # the autoscaler reports none.
    ceiling = None if fixed else ray._private.state.state.get_max_resources_from_cluster_config()
    return ClusterView(fixed_size=fixed, now=dict(ray.cluster_resources()), max=ceiling)


def trial_concurrency(job, n_trials: int, cluster: ClusterView) -> tuple[int, str]:
    """How many trials run side by side, and why (for the log).

    A trial needs its workers' GPUs on GPU, else the CPUs of its workers, its driver and its data pipeline (Tune
    does not see the workers: Ray Train reserves them when the trial starts). In order:
      - tune.max_concurrent_trials when set;
      - on a cluster this process started: as many trials as its resources hold (none is an error);
      - on a joined cluster whose autoscaler reports its maximum: as many as that maximum holds;
      - on a joined cluster holding at least one trial now: that many (the capacity asked for ahead of the sweep,
        e.g. with cluster/request_capacity.py, or a fixed cluster);
      - on a joined cluster holding none now (autoscaling from zero): every trial, each waiting for its workers:
        their resource requests make the autoscaler add nodes, and Ray Train retries a worker group's start
        until its nodes are up.
    Never more than the sweep has trials.
    """
    t, tune_cfg = job.train, job.tune
    if tune_cfg.max_concurrent_trials is not None:
        n = min(tune_cfg.max_concurrent_trials, n_trials)
        return n, f"tune.max_concurrent_trials={tune_cfg.max_concurrent_trials} (the sweep has {n_trials} trials)"
    if t.use_gpu:
        need, what = float(t.num_workers), "GPU"
    else:
        what = "CPU"
        need = t.num_workers * t.cpus_per_worker + tune_cfg.trial_driver_cpus + tune_cfg.data_cpus_per_trial
    per_trial = f"a trial needs {need:g} {what}"

    def fit(have: float) -> int:
        return math.floor(have / need + 1e-9)  # 16 / (1.0 + 0.1 + 0.5) is 10, whatever the rounding of 1.6

    have_now = cluster.now.get(what, 0.0)
    if cluster.fixed_size:
        _require(fit(have_now) >= 1, "train.num_workers", f"{per_trial} but this local cluster has {have_now:g}")
        return (min(fit(have_now), n_trials),
                f"this process's local cluster has {have_now:g} {what} and {per_trial}")
    if cluster.max is not None and what in cluster.max:
        ceiling = cluster.max[what]
        _require(fit(ceiling) >= 1, "train.num_workers",
                 f"{per_trial} but the autoscaler can grow the cluster to {ceiling:g} {what} at most")
        return (min(fit(ceiling), n_trials),
                f"the autoscaler can grow the cluster to {ceiling:g} {what} and {per_trial}")
    if fit(have_now) >= 1:
        return (min(fit(have_now), n_trials),
                f"the joined cluster has {have_now:g} {what} now and {per_trial}; if it can grow beyond that, set "
                f"tune.max_concurrent_trials to the number it holds then")
    return (n_trials, f"the joined cluster has {have_now:g} {what} now and {per_trial}: every trial starts and "
            f"waits for the nodes the autoscaler adds; set tune.max_concurrent_trials to run fewer at once")


def _open_parent_run(job, experiment_dir: str, tracking_uri: str, settings: list[dict[str, int]]) -> str:
    from pipeline.tracking import TrackingConfig, default_artifact_location, flatten, open_run

    parent_cfg = TrackingConfig(experiment=job.tracking.experiment, run_name=job.tune.name,
                                tags={**job.tracking.tags, "sweep": job.tune.name}, system_metrics=False,
                                registered_model_name=None)
    params = flatten({"tune": job.tune.to_dict(), "base": job.to_dict()})
    params = {k: v for k, v in params.items() if not k.startswith("base.tune.")}  # already under tune.
    params["tune.settings"] = json.dumps(settings)
    return open_run(parent_cfg, tracking_uri=tracking_uri,
                    artifact_location=default_artifact_location(tracking_uri, job.output_dir),
                    run_dir=experiment_dir, default_run_name=job.tune.name, params=params, artifacts={})


def param_space(tune_cfg: TuneConfig, settings: list[dict[str, int]]) -> dict[str, Any]:
    """Tune's search space over the valid settings: every one (grid, num_samples times) or num_samples draws."""
    from ray import tune

    seeds = {} if tune_cfg.init_seeds is None else {"init_seed": list(tune_cfg.init_seeds)}
    if tune_cfg.search == "grid":
        return {"nsa": tune.grid_search(settings), **{k: tune.grid_search(v) for k, v in seeds.items()}}
    return {"nsa": tune.choice(settings), **{k: tune.choice(v) for k, v in seeds.items()}}


def _build_tuner(plan: SweepPlan, settings: list[dict[str, int]], concurrency: int):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    tune_cfg = plan.tune
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=plan), {"CPU": tune_cfg.trial_driver_cpus})
    if tune.Tuner.can_restore(plan.experiment_dir):
        log.info("sweep: resuming %s", plan.experiment_dir)
        return tune.Tuner.restore(plan.experiment_dir, trainable=trainable, resume_unfinished=True,
                                  resume_errored=True)
    space = param_space(tune_cfg, settings)
    scheduler = (ASHAScheduler(time_attr="step", max_t=plan.max_steps, grace_period=tune_cfg.grace_period,
                               reduction_factor=tune_cfg.reduction_factor)
                 if tune_cfg.scheduler == "asha" else FIFOScheduler())
    experiment = Path(plan.experiment_dir) if _is_local(plan.experiment_dir) else None
    storage = str(experiment.parent) if experiment else plan.experiment_dir.rsplit("/", 1)[0]
    return tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler,
                                    # Tune ignores max_concurrent_trials when given a generator: limit it here
                                    search_alg=BasicVariantGenerator(max_concurrent=concurrency,
                                                                     random_state=tune_cfg.seed),
                                    num_samples=tune_cfg.num_samples,
                                    trial_dirname_creator=trial_dirname, trial_name_creator=trial_name),
        run_config=tune.RunConfig(name=tune_cfg.name, storage_path=storage,
                                  failure_config=tune.FailureConfig(max_failures=0)),
    )


def _result_row(result, plan: SweepPlan, tune_status: str) -> dict[str, Any]:
    """One trial's summary. tune_status: Tune's own (TERMINATED, ERROR, or PENDING/RUNNING/PAUSED when the
    sweep was interrupted)."""
    metrics = result.metrics or {}
    step = metrics.get("step", 0)
    if tune_status == "ERROR" or result.error is not None:
        status = "ERROR"
    elif tune_status != "TERMINATED":
        status = "UNFINISHED"  # the sweep was interrupted; rerunning it resumes this trial
    elif step >= plan.max_steps:
        status = "DONE"
    else:
        status = "STOPPED"  # ASHA stopped it early
    trial_id = Path(result.path).name
    return {"trial_id": trial_id, **full_setting(plan.job.model, result.config["nsa"]),
            "init_seed": result.config.get("init_seed", plan.job.train.seed),
            "status": status, "step": step, "tokens_seen": metrics.get("tokens_seen", 0),
            "tokens_per_s": float(metrics.get("tokens_per_s", float("nan"))),
            "val_loss": float(metrics.get("val_loss", float("nan"))),
            "peak_mem_mb": float(metrics.get("peak_mem_mb", float("nan"))),
            "startup_s": float(metrics.get("startup_s", float("nan"))),
            # when Tune took the trial's last report (seconds): its end where the trial could not close its own
            # MLflow run, as when the scheduler stopped it at a report (ASHA, also at the last step)
            "last_report_at": metrics.get("timestamp")}


def _finish_child_run(client, experiment_id: str, plan: SweepPlan, row: dict[str, Any]) -> str:
    """The trial's MLflow child run (made by its trainer) with the sweep's summary of it; made here if missing."""
    found = client.search_runs([experiment_id], filter_string=(
        f"tags.mlflow.parentRunId = '{plan.parent_run_id}' and tags.trial_id = '{row['trial_id']}'"))
    if found:
        run_id = found[0].info.run_id
    else:  # the trial failed before its trainer opened a run: record the failure anyway
        log.warning("sweep: trial %s has no MLflow run from its trainer; making one", row["trial_id"])
        run_id = client.create_run(experiment_id, run_name=f"{plan.tune.name}/{row['trial_id']}", tags={
            "mlflow.parentRunId": plan.parent_run_id, "trial_id": row["trial_id"], "sweep": plan.tune.name}).info.run_id
    existing = client.get_run(run_id).data.params
    for f in SWEPT_FIELDS:
        if f"nsa.{f}" not in existing:
            client.log_param(run_id, f"nsa.{f}", row[f])
    client.set_tag(run_id, "sweep.status", row["status"])
    for name in ("tokens_per_s", "val_loss", "peak_mem_mb", "startup_s"):
        if math.isfinite(row[name]):
            client.log_metric(run_id, f"trial.{name}", row[name], step=int(row["step"]))
    if row["status"] != "UNFINISHED":  # an unfinished trial's run stays open for the resumed sweep
        status = {"ERROR": "FAILED", "STOPPED": "KILLED", "DONE": "FINISHED"}[row["status"]]
        # the end the trial's own close gave the run, else its last report: the run's duration in the UI is then the
        # trial's, not the sweep's
        end_time = client.get_run(run_id).info.end_time
        if end_time is None and row.get("last_report_at") is not None:
            end_time = int(row["last_report_at"] * 1000)
        client.set_terminated(run_id, status=status, end_time=end_time)
    return run_id


def _report_to_mlflow(plan: SweepPlan, tracking_uri: str, rows: list[dict[str, Any]],
                      rejected: list[RejectedSetting], out_dir: Path) -> tuple[Path, Path]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_run(plan.parent_run_id).info.experiment_id
    for row in rows:
        row["mlflow_run_id"] = _finish_child_run(client, experiment_id, plan, row)
    rows[:] = summarize(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_csv, pareto_png = out_dir / "summary.csv", out_dir / "pareto.png"
    write_summary_csv(rows, summary_csv)
    plot_pareto(rows, pareto_png, f"{plan.tune.name}: throughput vs validation loss")
    rejected_json = out_dir / "rejected.json"
    rejected_json.write_text(json.dumps([dataclasses.asdict(r) for r in rejected], indent=1))
    for path in (summary_csv, pareto_png, rejected_json):
        client.log_artifact(plan.parent_run_id, str(path))
    client.log_metric(plan.parent_run_id, "trials", len(rows))
    client.log_metric(plan.parent_run_id, "rejected_settings", len(rejected))
    finite = [r for r in rows if math.isfinite(r["val_loss"])]
    if finite:
        client.log_metric(plan.parent_run_id, "best_val_loss", finite[0]["val_loss"])
        client.set_tag(plan.parent_run_id, "best_trial", finite[0]["trial_id"])
    interrupted = any(r["status"] == "UNFINISHED" for r in rows)
    client.set_terminated(plan.parent_run_id, status="KILLED" if interrupted else "FINISHED")
    return summary_csv, pareto_png


def _with_prepared_data(job):
    """The job reading prepared blocks: made once here (or reused) when tune.prepare_data and no packed_dir."""
    if not job.tune.prepare_data or job.data.packed_dir is not None:
        return job
    from pipeline.data import default_packed_dir, prepare_blocks

    packed_dir = default_packed_dir(job.data)
    if (packed_dir / "manifest.json").exists():
        log.info("sweep: reading the prepared blocks in %s", packed_dir)
    else:
        log.info("sweep: preparing the data once for every trial in %s", packed_dir)
        prepare_blocks(job.data, packed_dir)
    return job.replace(data=job.data.replace(packed_dir=str(packed_dir)))


def init_ray(num_cpus: int | None = None) -> None:
    """Join the cluster of RAY_ADDRESS (e.g. under `ray job submit`), else start a local one
    (pipeline/ray_cluster.py: why a local one serves its State API on a known port)."""
    what = _init_ray(num_cpus)
    if what.startswith("joined"):
        log.info("sweep: joined the Ray cluster at %s", os.environ["RAY_ADDRESS"])
    else:
        log.info("sweep: %s", what)


def run_sweep(job) -> SweepResult:
    """Run (or resume) the sweep of job.tune over job's training setup; returns its summary."""
    from pipeline.config import resolve_paths
    from pipeline.tracking import resolve_tracking_uri

    _require(job.tune is not None, "tune", "the config has no tune section; a sweep needs one")
    job = resolve_paths(job)
    settings, rejected = plan_settings(job)
    max_steps = steps_for_budget(job, job.tune.token_budget)
    check_sweep(job, settings, max_steps)

    init_ray()
    job = _with_prepared_data(job)
    experiment_dir = _absolute(job.tune.storage_path).rstrip("/") + "/" + job.tune.name
    _check_same_sweep(experiment_dir, sweep_record(job, settings, max_steps))
    tracking_uri = resolve_tracking_uri(job.tracking, job.output_dir)
    job = job.replace(tracking=dataclasses.replace(job.tracking, tracking_uri=tracking_uri))  # trials log there too
    parent_run_id = _open_parent_run(job, experiment_dir, tracking_uri, settings)
    plan = SweepPlan(job=job, tune=job.tune, max_steps=max_steps, experiment_dir=experiment_dir,
                     parent_run_id=parent_run_id)

    n_trials = len(settings) * job.tune.num_samples if job.tune.search == "grid" else job.tune.num_samples
    concurrency, why = trial_concurrency(job, n_trials, cluster_view())
    log.info("sweep %s: %d trials of %d steps, MLflow parent run %s", job.tune.name, n_trials, max_steps,
             parent_run_id)
    log.info("sweep %s: %d trial(s) at a time: %s", job.tune.name, concurrency, why)
    grid = _build_tuner(plan, settings, concurrency).fit()

    from ray.tune import ExperimentAnalysis

    tune_status = {t.trial_id: t.status for t in ExperimentAnalysis(experiment_dir).trials}
    if any(status not in ("TERMINATED", "ERROR") for status in tune_status.values()):
        # Interrupted (Ctrl-C): Tune saved its state but leaves running trials training until this driver exits,
        # past their last registered checkpoint, steps that the resumed sweep would then train and log again.
        log.warning("sweep %s: interrupted; stopping its running trials now (rerun the same command to resume)",
                    job.tune.name)
        import ray

        ray.shutdown()
    rows = [_result_row(result, plan, tune_status.get(Path(result.path).name, "UNKNOWN")) for result in grid]
    out_dir = Path(experiment_dir) if _is_local(experiment_dir) else Path(job.output_dir) / "sweeps" / job.tune.name
    summary_csv, pareto_png = _report_to_mlflow(plan, tracking_uri, rows, rejected, out_dir)
    return SweepResult(rows=rows, rejected=rejected, experiment_dir=experiment_dir, tracking_uri=tracking_uri,
                       parent_run_id=parent_run_id, summary_csv=summary_csv, pareto_png=pareto_png)
