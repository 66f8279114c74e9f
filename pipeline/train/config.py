"""TrainConfig: everything the training loop needs that is not the model or the data.

Counts are in optimizer steps and in blocks (one block = seq_len + 1 tokens, one training sequence).
A step consumes `global_batch` blocks: `micro_batch` blocks per rank per forward, `grad_accum` forwards per step.
Every field is checked when the object is built; checks that need the other sections live in
pipeline/config.py (preflight).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class DebugConfig:
    """Fault-injection hooks used only by tests; all off by default, refused in long runs by preflight."""

    fail_at_step: int | None = None  # a worker dies (os._exit) once, just before running this step
    fail_rank: int = 0  # the rank that dies
    nan_at_steps: tuple[int, ...] = ()  # rank 0's loss is multiplied by NaN at these steps
    stall_at_step: int | None = None  # the loop stops making progress at this step (watchdog test)
    stall_seconds: float = 3600.0
    stop_after_step: int | None = None  # the run ends cleanly after the checkpoint of this step (a stop to resume)
    trace: bool = False  # every rank appends (step, loss, block ids and token sums) to <run dir>/trace/rank<r>.jsonl

    def __post_init__(self) -> None:
        object.__setattr__(self, "nan_at_steps", tuple(self.nan_at_steps or ()))
        for name in ("fail_at_step", "stall_at_step", "stop_after_step"):
            v = getattr(self, name)
            _require(v is None or (_is_int(v) and v >= 0), f"train.debug.{name}", f"must be None or an int >= 0, got {v!r}")
        _require(_is_int(self.fail_rank) and self.fail_rank >= 0, "train.debug.fail_rank", f"must be an int >= 0, got {self.fail_rank!r}")
        _require(all(_is_int(s) and s >= 0 for s in self.nan_at_steps), "train.debug.nan_at_steps",
                 f"must be a list of ints >= 0, got {self.nan_at_steps!r}")
        _require(_is_number(self.stall_seconds) and self.stall_seconds > 0, "train.debug.stall_seconds",
                 f"must be positive, got {self.stall_seconds!r}")
        _require(isinstance(self.trace, bool), "train.debug.trace", f"must be a bool, got {self.trace!r}")

    @property
    def injects_faults(self) -> bool:
        return (self.fail_at_step is not None or bool(self.nan_at_steps) or self.stall_at_step is not None
                or self.stop_after_step is not None)


@dataclass(frozen=True)
class TrainConfig:
    # --- the run and where it lives
    run_name: str = "tiny"  # Ray Train run name; rerunning the same name resumes from its latest checkpoint
    storage_path: str = "outputs/ray_results"  # local folder or a pyarrow URI (s3://, gs://)
    seed: int = 1337
    # --- scaling
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 0.5  # fractional on small CPU hosts so Ray Data tasks still get scheduled
    # ddp: torch DistributedDataParallel (bucketed all-reduces overlapped with the backward); fsdp: FSDP2
    # (torch.distributed.fsdp.fully_shard); allreduce: replicas whose gradients live in one flat buffer, all-reduced
    # once after the step's last backward (one collective, no overlap): the data parallelism that runs under CUDA
    # graphs, where DDP's per-bucket hooks would fire outside the replayed graph
    parallelism: Literal["ddp", "fsdp", "allreduce"] = "ddp"
    precision: Literal["fp32", "bf16"] = "fp32"  # compute dtype under autocast; parameters are always fp32
    compile: bool = False
    # torch.compile mode: "reduce-overhead" replays the compiled forward and backward as CUDA graphs (no host
    # launch cost per kernel; one GPU worker only, see __post_init__)
    compile_mode: Literal["default", "reduce-overhead"] = "default"
    # GPU workers compile their NSA layers' Triton kernels before the first step, side by side, instead of one after
    # another at their first launches inside it (nsa_model/precompile.py)
    precompile_kernels: bool = True
    # torch.compile's artifacts shared through storage, so a cold node's first step finds them
    # (pipeline/train/compile_cache.py); the folder or URI every node reads, default <storage_path>/compile_cache
    compile_cache: bool = True
    compile_cache_path: str | None = None
    activation_checkpointing: bool = False  # each block recomputed in the backward from its input
    # each attention module keeps only its input and its attention core's results for the backward and recomputes
    # the rest (projections, RoPE; NSA's compressed and window outputs): saves less than the above, costs less time
    attention_recompute: bool = False
    # --- batch and length, in blocks and optimizer steps
    global_batch: int = 8  # blocks per optimizer step, over all ranks and accumulation micro-steps
    micro_batch: int = 4  # blocks per rank per forward
    max_steps: int = 250  # one pass over the embedded corpus (~2.2k blocks of 256 tokens) at 8 blocks a step
    # --- optimizer: AdamW with decoupled weight decay, none on norms, biases and embeddings
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 25
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the last fraction of the steps decays linearly to min_lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured and logged)
    # --- cadence
    log_every: int = 10  # metrics are synced to the host and reported only every log_every steps
    val_every: int = 100  # 0: validate only at the end
    val_batches: int = 4  # micro-batches per rank per validation
    checkpoint_every: int = 100  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    # --- guards
    max_failures: int = 1  # worker failures Ray Train recovers from (restart from the last checkpoint)
    max_consecutive_nonfinite: int = 5  # steps with NaN/inf loss or gradient skipped in a row before the run stops
    watchdog_seconds: float = 600.0  # a step phase without progress for this long fails the run with stack dumps
    # --- MFU: model FLOPs / (tokens/s) over this peak; None means no MFU (e.g. CPU)
    peak_tflops_per_device: float | None = None
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self) -> None:
        if isinstance(self.debug, dict):
            known = {f.name for f in dataclasses.fields(DebugConfig)}
            bad = sorted(set(self.debug) - known)
            _require(not bad, "train.debug", f"unknown field(s) {bad}; known: {sorted(known)}")
            object.__setattr__(self, "debug", DebugConfig(**self.debug))
        _require(isinstance(self.debug, DebugConfig), "train.debug", f"must be a mapping, got {self.debug!r}")
        _require(isinstance(self.run_name, str) and self.run_name.strip() != "" and "/" not in self.run_name,
                 "train.run_name", f"must be a non-empty name without '/', got {self.run_name!r}")
        _require(isinstance(self.storage_path, str) and self.storage_path != "", "train.storage_path",
                 f"must be a non-empty path or URI, got {self.storage_path!r}")
        for name in ("num_workers", "global_batch", "micro_batch", "max_steps", "log_every", "keep_checkpoints",
                     "max_consecutive_nonfinite", "val_batches"):
            v = getattr(self, name)
            _require(_is_int(v) and v > 0, f"train.{name}", f"must be a positive int, got {v!r}")
        for name in ("seed", "warmup_steps", "val_every", "checkpoint_every", "max_failures"):
            v = getattr(self, name)
            _require(_is_int(v) and v >= 0, f"train.{name}", f"must be an int >= 0, got {v!r}")
        for name in ("use_gpu", "compile", "precompile_kernels", "compile_cache", "activation_checkpointing",
                     "attention_recompute"):
            v = getattr(self, name)
            _require(isinstance(v, bool), f"train.{name}", f"must be a bool, got {v!r}")
        p = self.compile_cache_path
        _require(p is None or (isinstance(p, str) and p.strip() != ""), "train.compile_cache_path",
                 f"must be a non-empty path or URI (or unset: <storage_path>/compile_cache), got {p!r}")
        _require(not (self.activation_checkpointing and self.attention_recompute), "train.attention_recompute",
                 "pick one: train.activation_checkpointing already recomputes the whole block, attention included")
        _require(self.parallelism in ("ddp", "fsdp", "allreduce"), "train.parallelism",
                 f"must be 'ddp', 'fsdp' or 'allreduce', got {self.parallelism!r}")
        _require(self.compile_mode in ("default", "reduce-overhead"), "train.compile_mode",
                 f"must be 'default' or 'reduce-overhead', got {self.compile_mode!r}")
        if self.compile_mode == "reduce-overhead":
            _require(self.compile and self.use_gpu, "train.compile_mode",
                     "'reduce-overhead' (CUDA graphs) needs train.compile=true and train.use_gpu=true")
            _require(self.num_workers == 1 or self.parallelism == "allreduce", "train.compile_mode",
                     f"'reduce-overhead' (CUDA graphs) on {self.num_workers} workers needs train.parallelism="
                     f"allreduce (one all-reduce after the backward): DDP's and FSDP's gradient hooks run outside "
                     f"the graphs; got train.parallelism={self.parallelism!r}")
        _require(self.precision in ("fp32", "bf16"), "train.precision", f"must be 'fp32' or 'bf16', got {self.precision!r}")
        _require(self.schedule in ("cosine", "wsd", "constant"), "train.schedule",
                 f"must be 'cosine', 'wsd' or 'constant', got {self.schedule!r}")
        _require(_is_number(self.cpus_per_worker) and self.cpus_per_worker > 0, "train.cpus_per_worker",
                 f"must be positive, got {self.cpus_per_worker!r}")
        _require(_is_number(self.lr) and self.lr > 0, "train.lr", f"must be positive, got {self.lr!r}")
        _require(_is_number(self.min_lr) and 0 <= self.min_lr <= self.lr, "train.min_lr",
                 f"must be in [0, lr={self.lr}], got {self.min_lr!r}")
        _require(self.warmup_steps <= self.max_steps, "train.warmup_steps",
                 f"must be <= max_steps ({self.warmup_steps} > {self.max_steps})")
        _require(_is_number(self.decay_fraction) and 0 < self.decay_fraction <= 1, "train.decay_fraction",
                 f"must be in (0, 1], got {self.decay_fraction!r}")
        _require(_is_number(self.weight_decay) and self.weight_decay >= 0, "train.weight_decay",
                 f"must be >= 0, got {self.weight_decay!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _require(_is_number(v) and 0 <= v < 1, f"train.{name}", f"must be in [0, 1), got {v!r}")
        _require(_is_number(self.eps) and self.eps > 0, "train.eps", f"must be positive, got {self.eps!r}")
        _require(_is_number(self.grad_clip) and self.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {self.grad_clip!r}")
        _require(_is_number(self.watchdog_seconds) and self.watchdog_seconds > 0, "train.watchdog_seconds",
                 f"must be positive, got {self.watchdog_seconds!r}")
        p = self.peak_tflops_per_device
        _require(p is None or (_is_number(p) and p > 0), "train.peak_tflops_per_device", f"must be None or positive, got {p!r}")
        _require(self.global_batch % (self.micro_batch * self.num_workers) == 0, "train.global_batch",
                 f"must be a multiple of micro_batch * num_workers = {self.micro_batch} * {self.num_workers} "
                 f"= {self.micro_batch * self.num_workers}, got {self.global_batch}")

    @property
    def grad_accum(self) -> int:
        """Forward/backward passes per rank per optimizer step."""
        return self.global_batch // (self.micro_batch * self.num_workers)
