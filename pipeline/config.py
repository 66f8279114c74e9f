"""JobConfig: the one typed config of a job, from YAML plus dotted overrides, checked in full by preflight.

    job = load_job_config("configs/tiny.yaml", ["train.max_steps=10", "model.dim=64"])
    preflight(job)   # raises ValueError naming the field before any worker starts

Sections: model (a preset plus field overrides), data (pipeline.data.config.DataConfig), train
(pipeline.train.config.TrainConfig), tracking (pipeline.tracking.TrackingConfig), tune (pipeline.tune.TuneConfig,
read only by jobs/sweep.py). With no file, the embedded defaults are configs/tiny.yaml.
"""

from __future__ import annotations

import copy
import re
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nsa_model.config import ModelConfig, get_preset
from pipeline.tracking import TrackingConfig
from pipeline.train.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
SECTIONS = ("model", "data", "train", "tracking", "tune")
LONG_RUN_STEPS = 1000  # runs at least this long must checkpoint and may not carry test hooks
MAX_CHECKPOINT_GAP_LONG_RUN = 2000  # steps a long run may lose to a crash


def _data_config_class():
    from pipeline.data.config import DataConfig

    return DataConfig


def _build(cls, section: str, values: dict[str, Any]):
    """cls(**values) with unknown keys refused by name (a typo must not be ignored)."""
    if not isinstance(values, dict):
        raise ValueError(f"{section}: must be a mapping, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{section}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**values)


def build_model_config(section: dict[str, Any]) -> ModelConfig:
    """`{preset: tiny, dim: 64, nsa: {window: 32}}` -> the preset with those fields replaced."""
    if not isinstance(section, dict):
        raise ValueError(f"model: must be a mapping, got {section!r}")
    section = dict(section)
    preset = section.pop("preset", "tiny")
    base = get_preset(preset).to_dict()
    nsa_overrides = section.pop("nsa", None) or {}
    if not isinstance(nsa_overrides, dict):
        raise ValueError(f"model.nsa: must be a mapping, got {nsa_overrides!r}")
    base.update(section)
    base["nsa"] = {**base["nsa"], **nsa_overrides}
    return ModelConfig.from_dict(base)


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig
    data: Any  # pipeline.data.config.DataConfig
    train: TrainConfig
    tracking: TrackingConfig
    tune: Any = None  # pipeline.tune.TuneConfig, when the file has a tune section
    raw: dict[str, Any] = field(default_factory=dict, compare=False)  # the merged YAML, as given

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobConfig":
        unknown = sorted(set(d) - set(SECTIONS))
        if unknown:
            raise ValueError(f"config: unknown section(s) {unknown}; known: {list(SECTIONS)}")
        model_section = dict(d.get("model") or {})
        model_section.setdefault("preset", "tiny")
        tune = None
        if d.get("tune") is not None:
            from pipeline.tune import TuneConfig

            tune = _build(TuneConfig, "tune", d["tune"])
        return cls(model=build_model_config(model_section),
                   data=_build(_data_config_class(), "data", d.get("data") or {}),
                   train=_build(TrainConfig, "train", d.get("train") or {}),
                   tracking=_build(TrackingConfig, "tracking", d.get("tracking") or {}),
                   tune=tune, raw=copy.deepcopy(d))

    def to_dict(self) -> dict[str, Any]:
        """The resolved config: every field, defaults included (what the run logs and checkpoints)."""
        out = {"model": {"preset": (self.raw.get("model") or {}).get("preset", "tiny"), **self.model.to_dict()},
               "data": dataclasses.asdict(self.data), "train": dataclasses.asdict(self.train),
               "tracking": dataclasses.asdict(self.tracking)}
        if self.tune is not None:
            out["tune"] = dataclasses.asdict(self.tune)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(_plain(self.to_dict()), sort_keys=False)

    def replace(self, **sections: Any) -> "JobConfig":
        return dataclasses.replace(self, **sections)

    def with_overrides(self, overrides: list[str]) -> "JobConfig":
        """A new JobConfig: this one's raw YAML with more `section.key=value` overrides applied."""
        return JobConfig.from_dict(apply_overrides(self.raw, overrides))

    # --- derived locations (DESIGN.md "Outputs")
    @property
    def run_dir(self) -> str:
        return self.train.storage_path.rstrip("/") + "/" + self.train.run_name

    @property
    def output_dir(self) -> str:
        return getattr(self.data, "output_dir", "outputs")


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a copy of d; values are parsed as YAML (10, 1e-3, true, null, [1, 2])."""
    d = copy.deepcopy(d)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected section.key=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS or not all(parts):
            raise ValueError(f"override {item!r}: the key must be <section>.<field>[.<field>] with section one of "
                             f"{list(SECTIONS)}")
        node = d
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            if not isinstance(node[p], dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = parse_value(text)
    return d


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def parse_value(text: str) -> Any:
    """An override's value as YAML, except that 1e-3 is a number (YAML 1.1 reads it as a string).
    Words stay words: `train.run_name=nan` is the name "nan", not a float."""
    if _NUMBER.fullmatch(text.strip()):
        return int(text) if re.fullmatch(r"[+-]?\d+", text.strip()) else float(text)
    return yaml.safe_load(text) if text.strip() != "" else ""


def load_job_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (default configs/tiny.yaml), apply overrides, build every section (field checks)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    d = yaml.safe_load(path.read_text()) or {}
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must hold a mapping of sections, got {type(d).__name__}")
    try:
        return JobConfig.from_dict(apply_overrides(d, list(overrides or [])))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e


def resolve_paths(job: JobConfig) -> JobConfig:
    """Make local paths absolute, so workers (whose working directory may differ) see the same places."""
    def absolute(p: str | None) -> str | None:
        if p is None or "://" in p:
            return p
        return str(Path(p).resolve())

    train = dataclasses.replace(job.train, storage_path=absolute(job.train.storage_path),
                                compile_cache_path=absolute(job.train.compile_cache_path))
    data_changes = {}
    for name in ("output_dir", "packed_dir"):
        if hasattr(job.data, name) and getattr(job.data, name) is not None:
            data_changes[name] = absolute(getattr(job.data, name))
    source = getattr(job.data, "source", None)
    if isinstance(source, str) and source != "embedded" and "://" not in source and Path(source).exists():
        data_changes["source"] = absolute(source)
    data = dataclasses.replace(job.data, **data_changes) if data_changes else job.data
    return job.replace(train=train, data=data)


def preflight(job: JobConfig, *, tokenizer_vocab_size: int | None = None, gpus_available: int | None = None) -> None:
    """Refuse, before anything starts, a config that cannot work or cannot be meant. Raises ValueError.

    tokenizer_vocab_size: when given (the caller loaded the tokenizer), checked against the model's vocab.
    gpus_available: when given (the caller asked the cluster), checked against the GPUs the run needs.
    """
    m, d, t = job.model, job.data, job.train
    seq_len = getattr(d, "seq_len")
    if seq_len > m.max_seq_len:
        raise ValueError(f"data.seq_len: {seq_len} is longer than the model's max_seq_len {m.max_seq_len}")
    if t.global_batch % (t.micro_batch * t.num_workers) != 0:  # also checked by TrainConfig; kept for replace()
        raise ValueError(f"train.global_batch: {t.global_batch} is not a multiple of micro_batch * num_workers")
    if tokenizer_vocab_size is not None and tokenizer_vocab_size > m.vocab_size:
        raise ValueError(f"model.vocab_size: the tokenizer has {tokenizer_vocab_size} tokens but the model only "
                         f"{m.vocab_size} embeddings; raise model.vocab_size or use another tokenizer")
    if t.use_gpu and t.precision == "fp32":
        raise ValueError("train.precision: fp32 compute on GPU is refused (slow and never what a GPU run means); "
                         "use bf16 (parameters and optimizer state stay fp32)")
    if not t.use_gpu and t.precision == "bf16":
        raise ValueError("train.precision: bf16 autocast is for GPUs; on CPU use fp32")
    if t.parallelism == "fsdp" and t.num_workers == 1:
        raise ValueError("train.parallelism: fsdp with one worker shards nothing; use ddp")
    if t.peak_tflops_per_device is not None and not t.use_gpu:
        raise ValueError("train.peak_tflops_per_device: MFU is for accelerators; leave it null on CPU")
    if gpus_available is not None and t.use_gpu and gpus_available < t.num_workers:
        raise ValueError(f"train.num_workers: {t.num_workers} GPU workers asked, the cluster has {gpus_available} GPUs")
    if t.max_steps >= LONG_RUN_STEPS:
        if t.checkpoint_every == 0 or t.checkpoint_every > MAX_CHECKPOINT_GAP_LONG_RUN:
            raise ValueError(f"train.checkpoint_every: a run of {t.max_steps} steps must checkpoint at least every "
                             f"{MAX_CHECKPOINT_GAP_LONG_RUN} steps, got {t.checkpoint_every}")
        if t.debug.injects_faults or t.debug.trace:
            raise ValueError(f"train.debug: test hooks are refused in a run of {t.max_steps} steps "
                             f"(>= {LONG_RUN_STEPS}); they are for tests only")
    dbg = t.debug
    if dbg.fail_at_step is not None:
        if dbg.fail_rank >= t.num_workers:
            raise ValueError(f"train.debug.fail_rank: {dbg.fail_rank} but only {t.num_workers} workers")
        if t.max_failures == 0:
            raise ValueError("train.debug.fail_at_step: needs train.max_failures >= 1 to recover")
    if dbg.stop_after_step is not None and (t.checkpoint_every == 0 or dbg.stop_after_step % t.checkpoint_every):
        raise ValueError(f"train.debug.stop_after_step: {dbg.stop_after_step} is not a checkpoint step "
                         f"(train.checkpoint_every={t.checkpoint_every})")
    for name in ("fail_at_step", "stall_at_step", "stop_after_step"):
        v = getattr(dbg, name)
        if v is not None and v >= t.max_steps:
            raise ValueError(f"train.debug.{name}: {v} is past the last step {t.max_steps - 1}")
