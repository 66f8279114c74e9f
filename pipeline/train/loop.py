"""train_loop_per_worker: what every Ray Train worker runs.

Rank r of W reads only its own share of the data (its datasets train_<r> and val_<r>, pipeline/data/loader.py).
Optimizer step s consumes positions [s*PB, (s+1)*PB) of every rank's stream (PB = train.global_batch / W),
`micro_batch` at a time over `grad_accum` forward/backward passes; a rank whose share runs out wraps into its
next epoch, so every rank runs the same train.max_steps steps. A block is named in the trace and the checks by its
run block id, position * W + rank: step s's blocks are the ids [s*GB, (s+1)*GB) over all ranks. The loop checks
that every micro-batch holds exactly the blocks it should, so a data-position bug fails loudly.
Per step there is one small all-reduce ([loss, finite]) and one host sync, for the guard's count of non-finite
steps. With a fused optimizer (not under FSDP) that sync comes last: the optimizer skips a non-finite step on the
device (its found_inf), and the next step's first micro-batch is read before the sync, so the GPU waits less for
the host between steps. Everything else (metrics, NSA statistics) is synced only on the steps that report. The
gradients are summed by DDP's hooks during the last micro-batch's backward (ddp), by FSDP2 (fsdp), or by one
all-reduce of the FlatGradients buffer after it (allreduce).
"""

from __future__ import annotations

import contextlib
import itertools
import inspect
import json
import logging
import os
import resource
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from pipeline.train import checkpoint as ckpt
from pipeline.train.compile_cache import SharedCompileCache, cache_folder, graph_fields
from pipeline.train.config import TrainConfig
from pipeline.train.guards import NonFiniteGuard, Watchdog, WatchdogTimeout
from pipeline.train.schedule import build_optimizer, build_scheduler

log = logging.getLogger(__name__)


def expected_blocks(step: int, micro: int, *, rank: int, world: int, micro_batch: int, global_batch: int) -> list[int]:
    """Run block ids (position in rank's stream * world + rank) of micro-batch `micro` of optimizer step `step` on
    `rank`: positions step * global_batch / world + micro * micro_batch + j (DESIGN.md, "Data -> trainer")."""
    first = (step * (global_batch // world) + micro * micro_batch) * world + rank
    return [first + world * j for j in range(micro_batch)]


def run_block_ids(batches: Iterator[tuple[torch.Tensor, Any]], *, rank: int, world: int):
    """(tokens, positions in this rank's stream) -> (tokens, run block ids); closing it closes `batches`."""
    try:
        for tokens, positions in batches:
            yield tokens, [int(p) * world + rank for p in positions]
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def is_local(uri: str) -> bool:
    return "://" not in uri


# --- model -------------------------------------------------------------------------------------------------------

def build_model(job, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the wrapped model that trains, the bare Transformer underneath). Same seed on every rank: same init."""
    import ray.train.torch

    from nsa_model.model import Transformer

    t: TrainConfig = job.train
    torch.manual_seed(t.seed)
    bare = Transformer(job.model, activation_checkpointing=t.activation_checkpointing,
                       attention_recompute=t.attention_recompute).to(device)
    if t.parallelism == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # fp32 parameters (the master copy) are sharded; compute runs in the autocast dtype.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if t.precision == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
        for block in bare.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(bare, mp_policy=mp)
        return bare, bare
    if t.parallelism == "allreduce":  # replicas; the loop all-reduces their FlatGradients after each step's backward
        if dist.is_initialized() and dist.get_world_size() > 1:
            broadcast_from_rank0(bare)
        return bare, bare
    # DDP; the model's buffers (RoPE tables, NSA statistics) need no broadcast at every forward.
    wrapped = ray.train.torch.prepare_model(bare, move_to_device=False,
                                            parallel_strategy_kwargs=ddp_no_buffer_sync_kwargs())
    return wrapped, bare


def ddp_no_buffer_sync_kwargs() -> dict[str, bool]:
    """DDP's switch for the buffer broadcast at every forward, under the name this torch knows: torch 2.13 calls
    it forward_sync_buffers, torch 2.11 (the GPU hosts) broadcast_buffers and refuses the newer name."""
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


# --- per-interval metrics ------------------------------------------------------------------------------------------

@dataclass
class Interval:
    """Sums over the steps since the last report (host values: the per-step sync already brought them)."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    loss_sum: float = 0.0
    finite_steps: int = 0
    data_wait_s: float = 0.0
    compute_s: float = 0.0

    def add(self, loss: float, finite: bool, data_wait_s: float, compute_s: float) -> None:
        self.steps += 1
        self.data_wait_s += data_wait_s
        self.compute_s += compute_s
        if finite:
            self.loss_sum += loss
            self.finite_steps += 1


@dataclass
class Startup:
    """Where a run's time goes before its steps reach their pace, in wall-clock seconds (rank 0 reports them once).

    launch: from the driver building the trainer to this worker entering its loop (Ray Train's controller and
    worker group, the worker process's imports, torch.distributed's setup); model: the model, optimizer and any
    checkpoint; compile_cache (compiled runs, train.compile_cache): torch.compile's artifacts and the NSA kernels'
    Triton cache entries loaded from the shared compile cache into the node's local caches
    (pipeline/train/compile_cache.py); kernels (GPU workers, train.precompile_kernels): the NSA layers' Triton
    kernels compiled side by side (nsa_model/precompile.py), or found in Triton's cache; data: what is left of
    reading the held-out micro-batches and the first training micro-batch (Ray Data's pipelines starting), which
    run on threads of their own beside the phases before it (StreamStart);
    first_step and second_step: the first two optimizer steps, which hold torch.compile's tracing and code
    generation, the Triton kernels' compilation where not done before, and, under CUDA graphs, their recording. A
    Tune trial pays all of it before its first measured step, so a sweep's budget is best judged against it
    (bench/results/train-summary.md, stop 76).
    """

    launched_at: float | None  # time.time() on the driver when it built the trainer; None: unknown or resumed
    entered: float = field(default_factory=lambda: time.time())
    phases: dict[str, float] = field(default_factory=dict)
    data_waits: dict[str, float] = field(default_factory=dict)  # of a step phase, the seconds its batches took
    compiles: CompileCounts | None = None  # what the phases compiled, where the loop counted it
    compile_cache: SharedCompileCache | None = None  # what the run loaded from / saved to the shared compile cache

    def mark(self, phase: str, data_wait_s: float | None = None) -> None:
        now = time.time()
        self.phases[phase] = now - self.entered - sum(self.phases.values())
        if data_wait_s is not None:
            self.data_waits[phase] = data_wait_s

    def metrics(self) -> dict[str, float]:
        m = {f"startup_{name}_s": seconds for name, seconds in self.phases.items()}
        m.update({f"startup_{name}_data_wait_s": seconds for name, seconds in self.data_waits.items()})
        launch = 0.0
        if self.launched_at is not None:  # clamped: the driver's clock may run ahead of another node's
            launch = m["startup_launch_s"] = max(self.entered - self.launched_at, 0.0)
        m["startup_total_s"] = launch + sum(self.phases.values())
        for part in (self.compiles, self.compile_cache):
            m.update(part.metrics() if part is not None else {})
        return m

    def line(self) -> str:
        m = self.metrics()
        parts = [f"{name} {m[f'startup_{name}_s']:.1f} s"
                 + (f" (waiting for data {self.data_waits[name]:.1f} s)" if name in self.data_waits else "")
                 for name in ("launch", *self.phases) if f"startup_{name}_s" in m]
        line = f"startup: {m['startup_total_s']:.1f} s to the end of the second step ({'; '.join(parts)})"
        return "; ".join([line] + [part.line() for part in (self.compiles, self.compile_cache) if part is not None])


_COUNTS_LOCK = threading.Lock()


@dataclass
class CompileCounts:
    """What a run compiled between start() and stop(), for Startup: the NSA kernels (Triton kernels of nsa_model,
    specialized on l' and n) this process compiled or read from Triton's on-disk cache, and the hits and misses of
    inductor's FX graph cache (a miss: inductor generated the graph's code again). A sweep's later trials on a node
    should find most of both in the caches its first trial left (bench/results/kernels-notes.md, v74, v75)."""

    nsa_compiled: int = 0
    nsa_compile_s: float = 0.0
    nsa_cached: int = 0
    fxgraph: dict[str, int] = field(default_factory=dict)  # hit / miss: counted since start()
    _previous_listener: Any = None

    def start(self) -> "CompileCounts":
        import triton

        self._previous_listener = triton.knobs.compilation.listener
        self.fxgraph = _fxgraph_counts()
        triton.knobs.compilation.listener = self._heard
        return self

    def stop(self) -> None:
        import triton

        if triton.knobs.compilation.listener == self._heard:  # a listener set after start() is left in place
            triton.knobs.compilation.listener = self._previous_listener
        now = _fxgraph_counts()
        self.fxgraph = {key: now[key] - self.fxgraph[key] for key in now}

    def _heard(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if getattr(getattr(src, "fn", None), "module", "").startswith("nsa_model."):  # not inductor's kernels
            with _COUNTS_LOCK:  # compile_nsa_kernels compiles on several threads at once
                if cache_hit:
                    self.nsa_cached += 1
                else:
                    self.nsa_compiled += 1
                    self.nsa_compile_s += times.total / 1e6  # microseconds, summed over kernels compiled together
        if self._previous_listener is not None:
            self._previous_listener(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                                    cache_hit=cache_hit)

    def metrics(self) -> dict[str, float]:
        return {"startup_nsa_kernels_compiled": self.nsa_compiled, "startup_nsa_compile_s": self.nsa_compile_s,
                "startup_nsa_kernels_cached": self.nsa_cached,
                "startup_fxgraph_cache_hits": self.fxgraph["hit"], "startup_fxgraph_cache_misses": self.fxgraph["miss"]}

    def line(self) -> str:
        return (f"NSA kernels: {self.nsa_compiled} compiled in {self.nsa_compile_s:.1f} s, {self.nsa_cached} from "
                f"Triton's cache; inductor's FX graph cache: {self.fxgraph['hit']} hits, {self.fxgraph['miss']} misses")


def _fxgraph_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {key: int(counters["inductor"][f"fxgraph_cache_{key}"]) for key in ("hit", "miss")}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB (process peak RSS)


def peak_reserved_mb(device: torch.device) -> float:
    """What the CUDA caching allocator held at most. Under CUDA graphs this is the measure that counts: the graphs'
    private pools hold the activations, and a replay allocates nothing that max_memory_allocated would see."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return peak_memory_mb(device)


def uses_cuda_graphs(t: TrainConfig) -> bool:
    return t.compile and t.compile_mode == "reduce-overhead"


def cudagraph_skips() -> int:
    """How many compiled graphs of this process inductor runs without CUDA graphs under reduce-overhead.

    Inductor falls back to plain launches for such a graph and says so only through a log artifact, so the loop
    reports the count. One cause seen here: torch <= 2.12 skips any graph one of whose inputs overlaps itself in
    memory, such as the unfold view phi's checkpoint saves for the backward (bench/results/kernels-notes.md, v13)."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"]["cudagraph_skips"])


class FlatGradients:
    """Every parameter's gradient as a view of one flat buffer, kept for the whole run: zeroed in place and never
    set to None, so autograd adds each backward into it.

    Two users. Under CUDA graphs a replayed backward writes its gradients into the graph's memory; had autograd
    adopted that output as .grad, the next micro-batch's replay would overwrite it before the accumulation read
    it. With train.parallelism=allreduce the ranks' gradients are summed by one all-reduce of the whole buffer."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGradients: one buffer needs parameters of one dtype on one device, got "
                             f"{sorted(map(str, kinds))}")
        (dtype, device), = kinds
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.params, self.views = params, []
        offset = 0
        for p in params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            self.views.append(p.grad)
            offset += p.numel()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() into the buffer, for a model that no DDP hook watches. Autograd would add each
        parameter's gradient with a launch of its own (254 per micro-batch for nsa-125m, 110 for dense: 1.8 and
        1.3 ms per training step at T = 2048 on the H100); one foreach add takes them all at once
        (bench/results/kernels-notes.md, v19)."""
        new = torch.autograd.grad(loss, self.params, allow_unused=True)
        used = [i for i, g in enumerate(new) if g is not None]
        torch._foreach_add_([self.views[i] for i in used], [new[i] for i in used])

    def zero_(self) -> None:
        self.buffer.zero_()

    def all_reduce(self) -> None:
        """Sum over the ranks. Each rank's backward already divided its loss by the world size, so the sum is the
        mean gradient of the global batch."""
        dist.all_reduce(self.buffer)


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does when it wraps a model): the same start even
    where an initialization is not seeded alike."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=0)


# --- the loop ------------------------------------------------------------------------------------------------------

def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import ray.train

    from nsa_model.model import compile_model
    from nsa_model.precompile import compile_nsa_kernels
    from pipeline.data.loader import iter_rank_batches, rank_dataset_name
    from pipeline.tracking import RunLogger

    job = loop_config["job"]
    t: TrainConfig = job.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if world != t.num_workers:
        raise RuntimeError(f"train.num_workers={t.num_workers} but Ray Train started {world} workers")
    if device.type == "cpu":
        # As many compute threads as CPUs reserved (at least 1): no oversubscription of the host's cores, and
        # the same thread count in every run, so CPU results are reproducible across restarts.
        torch.set_num_threads(max(1, int(t.cpus_per_worker)))
    startup = Startup(loop_config.get("launched_at"), compiles=CompileCounts().start())
    run_dir = loop_config["run_dir"]
    local_run_dir = Path(run_dir) if is_local(run_dir) else None

    def on_epoch(split: str):
        def report(epoch: int, blocks: int) -> None:
            print(f"data: rank {rank}'s share of the {split} split ended after {blocks} blocks; it continues with "
                  f"epoch {epoch} (the same blocks again, in the same order)", flush=True)
        return report

    def batches(split: str, start_block: int, wrap: bool) -> Iterator[tuple[torch.Tensor, list[int]]]:
        shard = ray.train.get_dataset_shard(rank_dataset_name(split, rank))  # this rank's own share
        return run_block_ids(iter_rank_batches(shard, batch_size=t.micro_batch, start_block=start_block, wrap=wrap,
                                               on_epoch=on_epoch(split)), rank=rank, world=world)

    # The held-out read starts now, beside the model's build and compilation (StreamStart); the training stream
    # once the checkpoint says where it resumes.
    held_out = batches("val", 0, wrap=False)
    val_start = StreamStart("val", lambda: _read_held_out(t, held_out))
    model, bare = build_model(job, device)
    optimizer = build_optimizer(bare, t, device)
    scheduler = build_scheduler(optimizer, t)
    guard = NonFiniteGuard(t.max_consecutive_nonfinite)
    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            position = ckpt.load(Path(d), rank=rank, world_size=world, model=model, optimizer=optimizer,
                                 scheduler=scheduler, global_batch=t.global_batch)
        guard.load_state_dict(position.guard)
        start_step = position.step
        startup.launched_at = None  # a restart within a fit would count the attempts before it as its launch
        if rank == 0:
            print(f"resumed from checkpoint at step {start_step} (every rank continues its share at block "
                  f"{position.rank_blocks})", flush=True)
    startup.mark("model")
    # Every rank consumed start_step * PB blocks of its share; wrapping, its stream never runs out.
    train_batches = Lookahead(batches("train", start_step * (t.global_batch // world), wrap=True))
    train_start = StreamStart("train", train_batches.prefetch)
    compute_dtype = torch.bfloat16 if t.precision == "bf16" else None  # under autocast; parameters stay fp32
    folder = cache_folder(t)
    if folder is not None:  # before any compilation, which then looks in the node's local caches
        startup.compile_cache = SharedCompileCache(folder, graph_fields(job, bare, device))
        startup.compile_cache.load()
        startup.mark("compile_cache")
    if t.precompile_kernels and device.type == "cuda":
        compile_nsa_kernels(bare, t.micro_batch, job.data.seq_len, dtype=compute_dtype)
        startup.mark("kernels")
    if startup.compile_cache is not None:  # the NSA kernels' Triton cache entries are the ones to share
        startup.compile_cache.stop_recording()
    # compile_model: the graph does not change with the NSA setting, so a sweep's trials on a node share it
    forward = compile_model(model, mode=t.compile_mode) if t.compile else model
    grads = FlatGradients(optimizer) if uses_cuda_graphs(t) or t.parallelism == "allreduce" else None
    autocast = (torch.autocast(device.type, dtype=compute_dtype) if compute_dtype is not None
                else contextlib.nullcontext())
    seq_len = job.data.seq_len
    tokens_per_step = t.global_batch * seq_len
    flops_per_token = bare.flops_per_token(seq_len)
    logger = (RunLogger(job.tracking, loop_config["tracking_uri"], loop_config["mlflow_run_id"])
              if rank == 0 and loop_config.get("mlflow_run_id") else None)
    if logger is not None and start_step > 0:
        logger.log_resume(start_step)

    dump_dir = str(local_run_dir / "watchdog") if local_run_dir else None
    interval = Interval()
    try:
        with Watchdog(t.watchdog_seconds, rank=rank, dump_dir=dump_dir) as watchdog:
            # The held-out micro-batches are read once: a share too small to validate fails here, on every rank
            # alike, before any training step. The watchdog covers a stream that never starts.
            watchdog.beat(start_step, "validation")
            val_set = _validation_set(t, val_start.join(), device)
            train_start.join()  # the first step's first micro-batch, read ahead
            startup.mark("data")
            for step in range(start_step, t.max_steps):
                _inject_faults(t, step, rank, watchdog, local_run_dir)
                sums = [] if t.debug.trace else None
                loss_value, finite, blocks, wait_s, compute_s, grad_norm, lr = _train_step(
                    t, step, rank, world, model, forward, autocast, optimizer, scheduler, guard, train_batches,
                    device, watchdog, block_sums=sums, grads=grads, prefetch_next=step + 1 < t.max_steps)
                interval.add(loss_value, finite, wait_s, compute_s)
                if step - start_step < 2:  # the step's host sync has waited for its work on the device
                    startup.mark("first_step" if step == start_step else "second_step", data_wait_s=wait_s)
                if t.debug.trace and local_run_dir is not None:
                    _trace(local_run_dir, rank, {"step": step, "loss": loss_value, "finite": finite, "blocks": blocks,
                                                  "block_sums": sums, "threads": torch.get_num_threads()})
                done = step + 1
                last = done == t.max_steps
                log_now = done % t.log_every == 0 or last
                val_now = (t.val_every and done % t.val_every == 0) or last
                ckpt_now = (t.checkpoint_every and done % t.checkpoint_every == 0) or last
                if not (log_now or val_now or ckpt_now):
                    continue
                metrics = _interval_metrics(interval, t, done, tokens_per_step, flops_per_token, lr, grad_norm,
                                            guard, device, bare, world)
                if val_now:
                    watchdog.beat(step, "validation")
                    metrics["val_loss"] = _validate(model if t.parallelism == "fsdp" else bare, autocast, val_set,
                                                    device)
                if startup is not None and (step - start_step >= 1 or last):  # once: the first report after two steps
                    startup.compiles.stop()
                    if rank == 0 and startup.compile_cache is not None:
                        startup.compile_cache.save()
                    metrics.update(startup.metrics())
                    if rank == 0:
                        print(startup.line(), flush=True)
                    startup = None
                if rank == 0:
                    _print_progress(metrics, t)
                if logger is not None:
                    logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=done)
                watchdog.beat(step, "checkpoint" if ckpt_now else "report")
                _report(metrics, ckpt_now, rank, model, optimizer, scheduler, guard, done, t, job, logger)
                interval = Interval()
                if t.debug.stop_after_step == done:
                    if rank == 0:
                        print(f"debug: stopping after the checkpoint of step {done}", flush=True)
                    if logger is not None:
                        logger.close()
                    return
    except WatchdogTimeout:
        raise WatchdogTimeout(watchdog.fired or "watchdog fired") from None
    finally:
        if startup is not None:  # the run ended before its startup report: Triton's listener is given back
            startup.compiles.stop()
    if logger is not None:
        _log_final_model(logger, bare, job)
        logger.close()


class StreamStart:
    """A data stream's first items read on a thread of its own, so that Ray Data's pipeline starts while this
    worker builds and compiles its model. Read one after the other on the main thread, the held-out batches and the
    training stream's first micro-batch took 25-29 s of a new H200 node's startup; side by side and beside the
    model, 8.5-9.4 s, though they slow the compiles they run beside (a cold node's kernels by 2 s;
    bench/results/kernels-notes.md, v79). The thread touches only host data and takes part in no collective, so
    the ranks' collectives keep their order. join() returns what the read returned, or raises what it raised.
    A daemon thread, not a ThreadPoolExecutor's: where the loop fails before join(), a stream that never delivers
    must not hold the worker process at its exit (the executor's threads are joined there)."""

    def __init__(self, name: str, read: Callable[[], Any]):
        self._read, self._result, self._error = read, None, None
        self._thread = threading.Thread(target=self._run, name=f"stream-start-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._read()
        except BaseException as error:  # handed to the main thread, which raises it at join()
            self._error = error

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Lookahead:
    """An iterator that can read its next item ahead (prefetch), while the GPU still runs the step before it: the
    host's time to take a micro-batch from Ray Data (about 1 ms) then stays out of the gap between two steps."""

    def __init__(self, items: Iterator):
        self.items, self.ahead, self.has_ahead = items, None, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.has_ahead:
            self.has_ahead = False
            item, self.ahead = self.ahead, None
            return item
        return next(self.items)

    def prefetch(self) -> None:
        if not self.has_ahead:
            try:
                self.ahead, self.has_ahead = next(self.items), True
            except StopIteration:  # the next __next__ raises it again, where the step reports it
                pass


def skips_on_device(t: TrainConfig, optimizer: torch.optim.Optimizer) -> bool:
    """Whether a non-finite step is skipped by the optimizer itself on the device (a fused Adam/AdamW reads a
    found_inf tensor, as under GradScaler) instead of by the host after a sync. Not under FSDP, whose parameters
    are DTensors beside the plain found_inf."""
    return bool(optimizer.defaults.get("fused")) and t.parallelism != "fsdp"


def _train_step(t, step, rank, world, model, forward, autocast, optimizer, scheduler, guard, train_batches, device,
                watchdog, block_sums: list[int] | None = None, grads: FlatGradients | None = None,
                prefetch_next: bool = False):
    """One optimizer step (grad_accum micro-batches). Returns host values for the metrics.
    block_sums (train.debug.trace): receives each block's token sum, taken from the host batch (no device sync).
    grads: the parameters' FlatGradients, required under CUDA graphs and with parallelism=allreduce.
    prefetch_next: read the next step's first micro-batch before this step's host sync (after the update is
    launched where skips_on_device; train_batches a Lookahead).

    The update: where skips_on_device, the optimizer, the gradients' zeroing and the schedule are all launched
    before the one sync, and a non-finite step (the same verdict on every rank) is skipped by the fused optimizer
    on the device; the guard then counts it and stops the run after too many in a row. Elsewhere the host syncs
    first and calls the optimizer only for a finite step. Both skip the same steps and leave the optimizer's state
    (moments, step count) as it was."""
    reduce_after_backward = t.parallelism == "allreduce" and world > 1
    if grads is None and (uses_cuda_graphs(t) or reduce_after_backward):
        raise ValueError("_train_step: CUDA graphs and parallelism=allreduce need the parameters' FlatGradients")
    # Each backward adds loss / (grad_accum * ranks summed by the all-reduce); DDP divides by the world itself.
    loss_divisor = t.grad_accum * (world if reduce_after_backward else 1)
    wait_s = compute_s = 0.0
    loss_sum = torch.zeros((), device=device)
    blocks: list[int] = []
    lr = scheduler.get_last_lr()[0]
    for micro in range(t.grad_accum):
        watchdog.beat(step, "data")
        t0 = time.perf_counter()
        try:
            tokens, indices = next(train_batches)
        except StopIteration:
            raise RuntimeError(f"rank {rank}: the training split ran out of blocks at step {step}, micro-batch {micro}; "
                               f"lower train.max_steps or add data") from None
        want = expected_blocks(step, micro, rank=rank, world=world, micro_batch=t.micro_batch,
                               global_batch=t.global_batch)
        got = [int(i) for i in indices]
        if got != want:
            raise RuntimeError(f"rank {rank} step {step} micro-batch {micro}: got blocks {got[:8]}..., expected "
                               f"{want[:8]}...; the data position is wrong")
        blocks += got
        if block_sums is not None:
            block_sums += tokens.sum(dim=1).tolist()
        t1 = time.perf_counter()
        watchdog.beat(step, "forward_backward")
        tokens = tokens.to(device, non_blocking=True)
        x, y = tokens[:, :-1], tokens[:, 1:]  # labels are the inputs shifted by one
        # DDP all-reduces gradients only on the last micro-batch of the step.
        sync = model.no_sync() if (micro < t.grad_accum - 1 and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync:
            if uses_cuda_graphs(t):  # the previous micro-batch's graph outputs are consumed: replay over them
                torch.compiler.cudagraph_mark_step_begin()
            with autocast:
                _, loss = forward(x, y)
            if rank == 0 and step in t.debug.nan_at_steps:
                loss = loss * float("nan")
            if grads is not None and not hasattr(model, "no_sync"):
                grads.backward(loss / loss_divisor)
            else:  # DDP's (and FSDP's) hooks reduce the gradients as autograd accumulates them
                (loss / loss_divisor).backward()
        loss_sum += loss.detach().float()
        wait_s += t1 - t0
        compute_s += time.perf_counter() - t1
    t2 = time.perf_counter()
    if reduce_after_backward:
        watchdog.beat(step, "all_reduce")
        grads.all_reduce()
    watchdog.beat(step, "optimizer")
    # The norm is measured here, after backward and before any zero_grad (clip returns the pre-clip norm).
    max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
        grad_norm = grad_norm.full_tensor()
    summary = torch.stack([loss_sum / t.grad_accum, (~torch.isfinite(loss_sum)).float()])
    if dist.is_initialized():
        dist.all_reduce(summary)
    values = torch.cat([summary, grad_norm.detach().float()[None]])  # loss sum, non-finite ranks, gradient norm
    on_device = skips_on_device(t, optimizer)
    if on_device:
        optimizer.found_inf = ((summary[1] > 0) | ~torch.isfinite(values[2])).float()
        optimizer.step()  # changes nothing where found_inf is 1
        _end_step(optimizer, scheduler, grads, stepped=True)
    if prefetch_next:
        watchdog.beat(step, "data")
        train_batches.prefetch()
        watchdog.beat(step, "optimizer")  # the sync below waits for the step's work on the device
    loss_value, finite, norm_value = _verdict(values, world, guard, step)
    if not on_device:
        if finite:
            optimizer.step()
        _end_step(optimizer, scheduler, grads, stepped=finite)
    compute_s += time.perf_counter() - t2
    return loss_value, finite, blocks, wait_s, compute_s, norm_value, lr


def _verdict(values: torch.Tensor, world: int, guard: NonFiniteGuard, step: int) -> tuple[float, bool, float]:
    """(mean loss, finite, gradient norm) of the step from [loss sum over ranks, non-finite ranks, norm] (the host
    sync), recorded by the guard, which raises after too many non-finite steps in a row."""
    loss_sum, nonfinite_ranks, norm_value = values.tolist()
    finite = nonfinite_ranks == 0 and bool(torch.isfinite(torch.tensor(norm_value)))
    guard.observe(step, finite)
    return loss_sum / world, finite, norm_value


def _end_step(optimizer, scheduler, grads: FlatGradients | None, stepped: bool) -> None:
    """The gradients zeroed and the schedule advanced; stepped: optimizer.step() was called this step (torch warns
    of a schedule step without one)."""
    if grads is not None:
        grads.zero_()  # in place: the views stay the parameters' gradients (FlatGradients)
    else:
        optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        if not stepped:  # a skipped step still advances the schedule (it is tied to the step index)
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def _interval_metrics(iv: Interval, t: TrainConfig, done: int, tokens_per_step: int, flops_per_token: float,
                      lr: float, grad_norm: float, guard: NonFiniteGuard, device, bare, world: int) -> dict[str, float]:
    elapsed = time.perf_counter() - iv.start
    tokens_per_s = iv.steps * tokens_per_step / max(elapsed, 1e-9)
    metrics = {
        "step": done, "tokens_seen": done * tokens_per_step,
        "train_loss": iv.loss_sum / iv.finite_steps if iv.finite_steps else float("nan"),
        "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
        "step_time_s": elapsed / iv.steps, "data_wait_s": iv.data_wait_s / iv.steps,
        "compute_s": iv.compute_s / iv.steps, "peak_mem_mb": peak_memory_mb(device),
        "peak_reserved_mb": peak_reserved_mb(device),
        "skipped_steps": guard.skipped_total,
    }
    if t.peak_tflops_per_device is not None:
        metrics["mfu"] = flops_per_token * tokens_per_s / (t.peak_tflops_per_device * 1e12 * world)
    if uses_cuda_graphs(t):
        metrics["cudagraph_skips"] = float(cudagraph_skips())
    for name, value in bare.attention_stats().items():  # the only sync of the NSA statistics
        metrics[name] = float(value)
    return metrics


def _read_held_out(t: TrainConfig, val_batches: Iterator[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
    """The first val_batches micro-batches of this rank's share of the held-out split, kept in host memory.

    Read once, then the stream is closed: every validation scores the same blocks, nothing is re-tokenized, and
    no half-consumed stream of the held-out split is left running while the next one starts (a second
    iteration of the val shard on a GPU host once delivered blocks from mid-stream, caught by the order check).
    No collective here: it runs on a StreamStart's thread."""
    held = [tokens for tokens, _ in itertools.islice(val_batches, t.val_batches)]
    close = getattr(val_batches, "close", None)
    if close is not None:
        close()
    return held


def _validation_set(t: TrainConfig, held: list[torch.Tensor],
                    device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """The held-out micro-batches _read_held_out read, once every rank holds val_batches of them (the ranks agree
    on the smallest count first, so all of them raise together and none waits in a collective for another)."""
    fewest = len(held)
    if dist.is_initialized():
        count = torch.tensor([fewest], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        fewest = int(count.item())
    if fewest == 0:
        raise RuntimeError("validation: the held-out split has no blocks on some rank; raise data.val_fraction")
    if fewest < t.val_batches:
        raise RuntimeError(f"validation: a rank's share of the held-out split holds only {fewest} micro-batch(es) "
                           f"of {t.micro_batch} blocks, train.val_batches asks {t.val_batches}; raise "
                           f"data.val_fraction or lower train.val_batches")
    return held


@torch.no_grad()
def _validate(model, autocast, val_set: list[torch.Tensor], device) -> float:
    """Mean loss over the validation micro-batches of every rank."""
    model.eval()
    total = torch.zeros(2, device=device)  # [sum of losses, batches]
    for tokens in val_set:
        tokens = tokens.to(device, non_blocking=True)
        with autocast:
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        total += torch.stack([loss.float(), torch.ones((), device=device)])
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)
    loss_sum, count = total.tolist()
    if count == 0:
        raise RuntimeError("validation: the held-out split has no blocks; raise data.val_fraction")
    return loss_sum / count


def _report(metrics, with_checkpoint, rank, model, optimizer, scheduler, guard, done, t, job, logger) -> None:
    import ray.train

    if not with_checkpoint:
        ray.train.report(metrics)
        return
    world = t.num_workers
    position = ckpt.TrainingPosition(step=done, rank_blocks=done * t.global_batch // world, world_size=world,
                                     guard=guard.state_dict())
    with tempfile.TemporaryDirectory(prefix="nsa-ckpt-") as tmp:
        ckpt.save(Path(tmp), rank=rank, model=model, optimizer=optimizer, scheduler=scheduler, position=position,
                  config_yaml=job.to_yaml())
        if logger is not None:
            logger.log_checkpoint(tmp, done)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"{ckpt.CHECKPOINT_PREFIX}{done:08d}")


def _log_final_model(logger, bare, job) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(bare, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with tempfile.TemporaryDirectory(prefix="nsa-model-") as tmp:
        torch.save(state, Path(tmp) / ckpt.MODEL_FILE)
        (Path(tmp) / ckpt.CONFIG_FILE).write_text(job.to_yaml())
        version = logger.log_final_model(tmp)
    if version is not None:
        print(f"registered model {job.tracking.registered_model_name!r} version {version}", flush=True)


def _print_progress(m: dict[str, float], t: TrainConfig) -> None:
    steps_left = t.max_steps - m["step"]
    eta = steps_left * m["step_time_s"]
    line = (f"step {m['step']}/{t.max_steps} | loss {m['train_loss']:.4f} | lr {m['lr']:.2e} | "
            f"{m['tokens_per_s']:.0f} tok/s | ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    if "val_loss" in m:
        line += f" | val {m['val_loss']:.4f}"
    if m.get("cudagraph_skips"):
        line += f" | {int(m['cudagraph_skips'])} compiled graph(s) without CUDA graphs"
    print(line, flush=True)


def _trace(run_dir: Path, rank: int, record: dict) -> None:
    path = run_dir / "trace" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({**record, "pid": os.getpid()}) + "\n")


def _inject_faults(t: TrainConfig, step: int, rank: int, watchdog: Watchdog, run_dir: Path | None) -> None:
    """Test hooks (train.debug), all off by default and refused in long runs by preflight."""
    dbg = t.debug
    if dbg.fail_at_step == step and rank == dbg.fail_rank and run_dir is not None:
        marker = run_dir / "debug" / f"failed_at_step_{step}"
        if not marker.exists():  # die once: the restarted worker passes this step
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            print(f"debug: rank {rank} dies at step {step}", flush=True)
            os._exit(1)
    if dbg.stall_at_step == step:
        watchdog.beat(step, "data")
        deadline = time.monotonic() + dbg.stall_seconds
        while time.monotonic() < deadline:  # short sleeps: the watchdog's exception lands between them
            time.sleep(0.05)
