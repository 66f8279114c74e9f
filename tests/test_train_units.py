"""Unit tests of the training stage that need no Ray: schedule, optimizer groups, accumulation, guards,
watchdog, checkpoint round trip, config loading and preflight."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
import time
from pathlib import Path

import pytest
import torch

from nsa_model.config import get_preset
from nsa_model.model import Transformer
from pipeline.config import JobConfig, apply_overrides, load_job_config, preflight
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import TrainConfig
from pipeline.train.guards import NonFiniteGuard, NonFiniteStepError, Watchdog, WatchdogTimeout
from pipeline.train import loop
from pipeline.train.loop import _read_held_out, _train_step, _validate, _validation_set, expected_blocks
from pipeline.train.schedule import build_optimizer, build_scheduler, lr_at, param_groups

TINY = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32"]


def small_model(seed: int = 0) -> Transformer:
    cfg = get_preset("tiny-dense").replace(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                                           max_seq_len=32)
    torch.manual_seed(seed)
    return Transformer(cfg)


# --- schedule ----------------------------------------------------------------------------------------------------

def scheduler_lrs(cfg: TrainConfig) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(cfg.max_steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedule_peak_at_end_of_warmup_and_min_at_last_step(schedule):
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=50, schedule=schedule, num_workers=1,
                      global_batch=4, micro_batch=4)
    lrs = scheduler_lrs(cfg)
    assert lrs[0] == pytest.approx(1e-4)  # (0 + 1) / 10 of the peak
    assert lrs[9] == pytest.approx(1e-3)  # the last warmup step trains at the peak
    assert max(lrs) == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)  # the last step trains at min_lr
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:]))  # never rises after warmup
    assert lrs == pytest.approx([lr_at(s, cfg) for s in range(50)])


def test_cosine_midpoint_and_wsd_plateau():
    cos = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=101, num_workers=1, global_batch=4, micro_batch=4)
    assert lr_at(50, cos) == pytest.approx(0.5)
    wsd = dataclasses.replace(cos, schedule="wsd", decay_fraction=0.2)
    assert lr_at(79, wsd) == pytest.approx(1.0) and lr_at(100, wsd) == pytest.approx(0.0)


def test_no_weight_decay_on_norms_biases_embeddings():
    model = small_model()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "tok_emb.weight" in no_decay_names
    assert not any("norm" in n for n in decay_names)
    assert any(n.endswith("ffn.w2.weight") for n in decay_names)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# --- one optimizer step: accumulation, guard ---------------------------------------------------------------------

class NoWatchdog:
    def beat(self, step, phase):
        pass


def run_one_step(cfg: TrainConfig, model, tokens: torch.Tensor, step: int = 0, guard=None, grads=None):
    """One _train_step on CPU without Ray; `grads` (a list) receives the gradients the optimizer stepped with."""
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    if grads is not None:
        opt.register_step_pre_hook(
            lambda o, args, kwargs: grads.extend(p.grad.clone() for g in o.param_groups for p in g["params"]))
    sched = build_scheduler(opt, cfg)
    b = cfg.micro_batch
    batches = iter([(tokens[i:i + b], list(range(step * cfg.global_batch + i, step * cfg.global_batch + i + b)))
                    for i in range(0, tokens.shape[0], b)])
    guard = guard or NonFiniteGuard(3)
    return _train_step(cfg, step, 0, 1, model, model, contextlib.nullcontext(), opt, sched, guard, batches,
                       torch.device("cpu"), NoWatchdog())


def test_accumulation_equals_one_big_batch():
    """4 micro-batches of 1 give the gradient (and loss, and grad norm) of one batch of 4."""
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    base = dict(num_workers=1, global_batch=4, max_steps=10, warmup_steps=0, lr=1e-2, grad_clip=0.0)
    grads_accum, grads_big = [], []
    loss_a, finite_a, blocks_a, *_, norm_a, _ = run_one_step(TrainConfig(micro_batch=1, **base), small_model(),
                                                             tokens, grads=grads_accum)
    loss_b, finite_b, blocks_b, *_, norm_b, _ = run_one_step(TrainConfig(micro_batch=4, **base), small_model(),
                                                             tokens, grads=grads_big)
    assert finite_a and finite_b and blocks_a == blocks_b == [0, 1, 2, 3]
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert norm_a == pytest.approx(norm_b, rel=1e-5)  # the same gradient, measured before zero_grad
    assert norm_a > 0 and len(grads_accum) == len(grads_big) > 0
    for ga, gb in zip(grads_accum, grads_big):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-7)


def test_under_cuda_graphs_gradients_accumulate_in_place_in_tensors_of_their_own(monkeypatch):
    """compile_mode = reduce-overhead: every parameter keeps one gradient tensor for the whole run (a view of one
    flat buffer, allocated up front, zeroed in place), so a replayed backward's output is added into it, never
    adopted as .grad; the step's gradient is the same as in default mode. (The CUDA graphs themselves need a GPU;
    this is the loop's side.)"""
    tokens = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(2))
    base = dict(num_workers=1, global_batch=4, micro_batch=2, max_steps=10, warmup_steps=0, lr=1e-2, grad_clip=0.0)
    plain = []
    run_one_step(TrainConfig(**base), small_model(), tokens, grads=plain)
    monkeypatch.setattr(loop, "uses_cuda_graphs", lambda t: True)
    model, graphed = small_model(), []
    opt = build_optimizer(model, TrainConfig(**base), torch.device("cpu"))
    grads = loop.FlatGradients(opt)
    own = [p.grad for p in model.parameters()]
    assert all(g._base is grads.buffer for g in own)  # views of the one buffer
    opt.register_step_pre_hook(
        lambda o, args, kwargs: graphed.extend(p.grad.clone() for g in o.param_groups for p in g["params"]))
    batches = iter([(tokens[i:i + 2], [i, i + 1]) for i in (0, 2)])
    cfg = TrainConfig(**base)
    with pytest.raises(ValueError, match="FlatGradients"):  # the loop always passes them under CUDA graphs
        _train_step(cfg, 0, 0, 1, model, model, contextlib.nullcontext(), opt, build_scheduler(opt, cfg),
                    NonFiniteGuard(3), iter([]), torch.device("cpu"), NoWatchdog())
    _train_step(cfg, 0, 0, 1, model, model, contextlib.nullcontext(), opt, build_scheduler(opt, cfg),
                NonFiniteGuard(3), batches, torch.device("cpu"), NoWatchdog(), grads=grads)
    assert all(p.grad is g for p, g in zip(model.parameters(), own))  # the same tensors, not replaced or dropped
    assert all(float(g.abs().sum()) == 0.0 for g in own)  # zeroed in place after the step
    assert len(graphed) == len(plain) > 0
    for a, b in zip(graphed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_flat_gradients_refuse_parameters_of_two_dtypes():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="FlatGradients: one buffer needs parameters of one dtype on one device"):
        loop.FlatGradients(torch.optim.SGD(params, lr=0.1))


def test_train_step_refuses_wrong_blocks():
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2)
    tokens = torch.randint(0, 64, (4, 33))
    with pytest.raises(RuntimeError, match="data position is wrong"):
        model = small_model()
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        batches = iter([(tokens, [4, 5, 6, 7])])  # step 0 must see blocks 0..3
        _train_step(cfg, 0, 0, 1, model, model, contextlib.nullcontext(), opt, build_scheduler(opt, cfg),
                    NonFiniteGuard(3), batches, torch.device("cpu"), NoWatchdog())


def test_expected_blocks_partition_each_step():
    W, b, GB = 2, 2, 8
    seen = []
    for step in range(3):
        for rank in range(W):
            for micro in range(GB // (b * W)):
                blocks = expected_blocks(step, micro, rank=rank, world=W, micro_batch=b, global_batch=GB)
                assert all(i % W == rank for i in blocks)  # run block id = position in rank's own stream * W + rank
                first = step * GB // W + micro * b  # every rank consumed step * GB / W blocks of its share before
                assert [i // W for i in blocks] == list(range(first, first + b))
                seen += blocks
    assert sorted(seen) == list(range(3 * GB))


def test_nan_step_is_skipped_and_counted():
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2,
                      debug={"nan_at_steps": [0]})
    model = small_model()
    before = copy.deepcopy(model.state_dict())
    guard = NonFiniteGuard(3)
    loss, finite, *_ = run_one_step(cfg, model, torch.randint(0, 64, (4, 33)), guard=guard)
    assert not finite and math.isnan(loss) and guard.skipped_total == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # no update from a NaN step
    for p in model.parameters():
        assert p.grad is None  # and no NaN gradient left behind for the next step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (passed on an H100, kernels-notes v45)"))])
def test_a_nan_step_skipped_on_the_device_leaves_what_the_host_skip_leaves(device):
    """The fused AdamW skips a non-finite step itself (found_inf, no host sync before the update); a foreach AdamW
    (FSDP on CPU) is not called for it. A NaN step then a finite one give the same parameters and the same
    optimizer state (one step counted) either way, and the guard counts the skip in both."""
    device = torch.device(device)
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=2, max_steps=10, warmup_steps=0, lr=1e-2,
                      weight_decay=0.1, debug={"nan_at_steps": [0]})
    tokens = [torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    results = []
    for fused in (True, False):
        model = small_model().to(device)
        opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, fused=fused)
        assert loop.skips_on_device(cfg, opt) is fused
        sched, guard = build_scheduler(opt, cfg), NonFiniteGuard(3)
        finite = []
        for step in (0, 1):
            batches = iter([(tokens[step][i:i + 2], list(range(4 * step + i, 4 * step + i + 2))) for i in (0, 2)])
            finite.append(_train_step(cfg, step, 0, 1, model, model, contextlib.nullcontext(), opt, sched, guard,
                                      batches, device, NoWatchdog())[1])
        assert finite == [False, True] and guard.skipped_total == 1
        assert {float(opt.state[p]["step"]) for p in model.parameters()} == {1.0}
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_next_steps_first_micro_batch_is_read_after_the_update_is_launched():
    """prefetch_next: the step reads the next step's first micro-batch after it has launched the optimizer (so the
    read overlaps the GPU's work instead of the gap between steps), and the next step takes that batch."""
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=2, max_steps=10, warmup_steps=0)
    model = small_model()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched, events = build_scheduler(opt, cfg), []
    opt.register_step_post_hook(lambda *args: events.append("update"))
    gen = torch.Generator().manual_seed(7)

    def stream():
        for block in itertools.count(0, 2):
            events.append(f"read {block}")
            yield torch.randint(0, 64, (2, 33), generator=gen), [block, block + 1]

    batches = loop.Lookahead(stream())
    for step in (0, 1):
        _train_step(cfg, step, 0, 1, model, model, contextlib.nullcontext(), opt, sched, NonFiniteGuard(3), batches,
                    torch.device("cpu"), NoWatchdog(), prefetch_next=step == 0)
    assert events == ["read 0", "read 2", "update", "read 4", "read 6", "update"]


def test_lookahead_keeps_the_order_and_reports_the_end_where_it_is_read():
    ahead = loop.Lookahead(iter([1, 2]))
    ahead.prefetch()
    ahead.prefetch()  # a second prefetch reads nothing more
    assert next(ahead) == 1 and next(ahead) == 2
    ahead.prefetch()  # past the end: nothing to read yet no error here
    with pytest.raises(StopIteration):
        next(ahead)


def test_stream_starts_read_side_by_side_and_hand_back_their_results_and_errors():
    """The held-out read and the training stream's first micro-batch start on threads of their own, together:
    each stream here yields only once the other has begun, so read one after the other they would never finish
    (the join's wait is bounded by the threads' own timeouts, not timed). An error in a read reaches the main
    thread at join(), where the loop raises it."""
    import threading

    val_begun, train_begun = threading.Event(), threading.Event()

    def stream(mine: threading.Event, other: threading.Event, first: int):
        mine.set()
        if not other.wait(timeout=30):
            raise RuntimeError("the other stream never started beside this one")
        for i in itertools.count(first):
            yield torch.full((2, 5), i), [2 * i, 2 * i + 1]

    t = TrainConfig(val_batches=2, micro_batch=2)
    val_start = loop.StreamStart("val", lambda: _read_held_out(t, stream(val_begun, train_begun, 0)))
    train_batches = loop.Lookahead(stream(train_begun, val_begun, 100))
    train_start = loop.StreamStart("train", train_batches.prefetch)
    held = _validation_set(t, val_start.join())
    assert train_start.join() is None
    assert [int(b[0, 0]) for b in held] == [0, 1]
    assert int(next(train_batches)[0][0, 0]) == 100 and int(next(train_batches)[0][0, 0]) == 101

    def broken():
        raise RuntimeError("block stream out of order")

    failed = loop.StreamStart("train", broken)
    with pytest.raises(RuntimeError, match="block stream out of order"):
        failed.join()


def test_guard_stops_after_k_in_a_row():
    guard = NonFiniteGuard(3)
    assert guard.observe(0, True)
    assert not guard.observe(1, False) and not guard.observe(2, False)
    assert guard.observe(3, True) and guard.consecutive == 0  # a good step resets the streak
    guard.observe(4, False), guard.observe(5, False)
    with pytest.raises(NonFiniteStepError, match="step 6: 3 consecutive"):
        guard.observe(6, False)
    assert guard.skipped_total == 5


# --- watchdog ----------------------------------------------------------------------------------------------------

def stalled_data_loader():
    time.sleep(0.05)


def test_watchdog_fails_a_stalled_step_with_step_phase_and_stacks(tmp_path):
    start = time.monotonic()
    with pytest.raises(WatchdogTimeout):
        with Watchdog(0.5, rank=0, dump_dir=str(tmp_path), grace_s=10, poll_s=0.05) as wd:
            wd.beat(7, "data")
            while time.monotonic() - start < 10:
                stalled_data_loader()
    assert time.monotonic() - start < 5
    assert "step 7" in wd.fired and "'data'" in wd.fired
    dump = (tmp_path / "rank0-step7.txt").read_text()
    assert "stalled_data_loader" in dump  # the stalled thread's stack is in the dump


def test_watchdog_quiet_while_progressing():
    with Watchdog(0.3, rank=0, poll_s=0.05) as wd:
        for step in range(10):
            wd.beat(step, "forward_backward")
            time.sleep(0.05)
    assert wd.fired is None


# --- checkpoint --------------------------------------------------------------------------------------------------

def test_checkpoint_round_trip_continues_identically(tmp_path):
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2)
    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 64, (4, 33), generator=gen) for _ in range(4)]

    def steps(model, opt, sched, start, stop):
        losses = []
        for s in range(start, stop):
            batches = iter([(data[s], list(range(4 * s, 4 * s + 4)))])
            losses.append(_train_step(cfg, s, 0, 1, model, model, contextlib.nullcontext(), opt, sched,
                                      NonFiniteGuard(3), batches, torch.device("cpu"), NoWatchdog())[0])
        return losses

    model = small_model()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg)
    straight = steps(model, opt, sched, 0, 4)

    model = small_model()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg)
    first = steps(model, opt, sched, 0, 2)
    ckpt.save(tmp_path, rank=0, model=model, optimizer=opt, scheduler=sched,
              position=ckpt.TrainingPosition(step=2, rank_blocks=8, world_size=1,
                                             guard={"skipped_total": 0, "consecutive": 0}),
              config_yaml="x: 1\n")
    model2 = small_model(seed=99)  # different init: everything must come from the checkpoint
    opt2 = build_optimizer(model2, cfg, torch.device("cpu"))
    sched2 = build_scheduler(opt2, cfg)
    pos = ckpt.load(tmp_path, rank=0, world_size=1, model=model2, optimizer=opt2, scheduler=sched2, global_batch=4)
    assert (pos.step, pos.rank_blocks, pos.world_size) == (2, 8, 1)
    assert sched2.get_last_lr() == sched.get_last_lr()
    second = steps(model2, opt2, sched2, 2, 4)
    assert first + second == straight  # bitwise on CPU
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "rng_rank0.pt", "train_state.pt"]


def test_checkpoint_load_refuses_pickled_objects(tmp_path):
    torch.save({"format_version": ckpt.FORMAT_VERSION, "evil": Path("/")}, tmp_path / ckpt.TRAIN_STATE)
    model = small_model()
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        ckpt.load(tmp_path, rank=0, world_size=1, model=model, optimizer=opt, scheduler=build_scheduler(opt, cfg),
                  global_batch=4)


@pytest.mark.parametrize("world_size, global_batch, state, message", [
    # The data shares are dealt by world size: another worker count cannot continue each rank's share exactly.
    (4, 8, {}, r"written by a run of 2 workers, this run has 4.*train.num_workers=2"),
    (2, 4, {}, r"8 blocks per rank after step 2 != step \* global_batch 4 / 2 workers"),
    # The whole-stream scheme's checkpoints held one global next_block, not a position in each rank's share.
    (2, 8, {"format_version": 1}, r"format 1, expected 2 \(format 1 was written when every rank read the whole"),
])
def test_checkpoint_load_refuses_a_data_position_it_cannot_continue(tmp_path, world_size, global_batch, state,
                                                                   message):
    cfg = TrainConfig(num_workers=2, global_batch=8, micro_batch=4, max_steps=10, warmup_steps=2)
    model = small_model()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    ckpt.save(tmp_path, rank=0, model=model, optimizer=opt, scheduler=build_scheduler(opt, cfg),
              position=ckpt.TrainingPosition(step=2, rank_blocks=8, world_size=2,
                                             guard={"skipped_total": 0, "consecutive": 0}), config_yaml="x: 1\n")
    if state:
        saved = torch.load(tmp_path / ckpt.TRAIN_STATE, weights_only=True)
        torch.save({**saved, **state}, tmp_path / ckpt.TRAIN_STATE)
    with pytest.raises(ValueError, match=message):
        ckpt.load(tmp_path, rank=0, world_size=world_size, model=model, optimizer=opt,
                  scheduler=build_scheduler(opt, cfg), global_batch=global_batch)


# --- config and preflight ----------------------------------------------------------------------------------------

def test_default_config_is_tiny_yaml_and_passes_preflight():
    job = load_job_config()
    assert job.model == get_preset("tiny")
    assert job.train == TrainConfig() and job.train.num_workers == 2 and job.train.cpus_per_worker == 0.5
    preflight(job, tokenizer_vocab_size=4096)
    round_trip = JobConfig.from_dict(job.to_dict())
    assert round_trip.train == job.train and round_trip.model == job.model and round_trip.data == job.data


def test_overrides_parse_yaml_values_and_nested_model_fields():
    job = load_job_config(None, TINY + ["train.lr=1e-3", "train.use_gpu=false", "model.nsa.window=16",
                                         "train.debug.nan_at_steps=[1, 2]", "train.run_name=nan"])
    assert job.train.lr == 1e-3 and job.model.dim == 32 and job.model.nsa.window == 16
    assert job.train.run_name == "nan"  # a word stays a word
    assert job.train.debug.nan_at_steps == (1, 2)


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch=6"], "train.global_batch: must be a multiple of micro_batch"),
    (["train.max_stepz=5"], r"train: unknown field\(s\) \['max_stepz'\]"),
    (["trian.max_steps=5"], "section one of"),
    (["model.dim=-1"], "ModelConfig.dim"),
    (["train.lr=0"], "train.lr: must be positive"),
    (["data.seq_len=0"], "seq_len"),
    (["train.max_steps"], "expected section.key=value"),
    (["train.compile_mode=max-autotune"], "train.compile_mode: must be 'default' or 'reduce-overhead'"),
    (["train.compile_mode=reduce-overhead"], r"train.compile_mode: 'reduce-overhead' \(CUDA graphs\) needs train.compile"),
    (["train.compile_mode=reduce-overhead", "train.compile=true", "train.use_gpu=true"],
     r"train.compile_mode: 'reduce-overhead' \(CUDA graphs\) on 2 workers needs train.parallelism=allreduce"),
    (["train.parallelism=zero"], "train.parallelism: must be 'ddp', 'fsdp' or 'allreduce'"),
    (["train.attention_recompute=sometimes"], "train.attention_recompute: must be a bool"),
    (["train.attention_recompute=true", "train.activation_checkpointing=true"],
     "train.attention_recompute: pick one: train.activation_checkpointing already recomputes the whole block"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_job_config(None, overrides)


def test_cuda_graphs_on_several_workers_run_with_allreduce():
    job = load_job_config(None, ["train.compile_mode=reduce-overhead", "train.compile=true", "train.use_gpu=true",
                                 "train.precision=bf16", "train.parallelism=allreduce"])
    assert job.train.num_workers == 2 and job.train.compile_mode == "reduce-overhead"


@pytest.mark.parametrize("overrides, kwargs, message", [
    (["data.seq_len=512"], {}, "data.seq_len: 512 is longer than the model's max_seq_len 256"),
    ([], {"tokenizer_vocab_size": 50257}, "model.vocab_size: the tokenizer has 50257"),
    (["train.use_gpu=true"], {}, "fp32 compute on GPU is refused"),
    (["train.precision=bf16"], {}, "bf16 autocast is for GPUs"),
    (["train.max_steps=5000", "train.checkpoint_every=0"], {}, "must checkpoint at least every"),
    (["train.max_steps=5000", "train.debug.trace=true"], {}, "test hooks are refused"),
    (["train.debug.fail_at_step=3", "train.max_failures=0"], {}, "needs train.max_failures"),
    (["train.debug.stall_at_step=400"], {}, "past the last step"),
    (["train.use_gpu=true", "train.precision=bf16"], {"gpus_available": 1}, "2 GPU workers asked"),
])
def test_preflight_refuses(overrides, kwargs, message):
    job = load_job_config(None, overrides)
    with pytest.raises(ValueError, match=message):
        preflight(job, **kwargs)


def test_apply_overrides_does_not_touch_input():
    raw = {"train": {"lr": 1.0}}
    out = apply_overrides(raw, ["train.lr=2", "tracking.tags.team=nsa"])
    assert raw == {"train": {"lr": 1.0}} and out == {"train": {"lr": 2}, "tracking": {"tags": {"team": "nsa"}}}


def test_ddp_buffer_switch_is_a_parameter_of_this_torch_ddp():
    """The GPU hosts' torch 2.11 refuses forward_sync_buffers (torch 2.13's name): the loop must pass the name
    the installed DistributedDataParallel takes."""
    import inspect

    from pipeline.train.loop import ddp_no_buffer_sync_kwargs

    kwargs = ddp_no_buffer_sync_kwargs()
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert len(kwargs) == 1 and all(k in params and v is False for k, v in kwargs.items())


def test_validation_reads_its_blocks_once_and_closes_the_stream():
    """Every validation scores the same first val_batches micro-batches; the held-out stream is read once and
    closed, never left half-consumed while a second pass starts."""
    t = TrainConfig(val_batches=2, micro_batch=2)
    pulled, closed = [], []

    def stream():
        try:
            for i in range(10):
                pulled.append(i)
                yield torch.full((2, 5), i), [2 * i, 2 * i + 1]
        finally:
            closed.append(True)

    gen = stream()  # held here, so only an explicit close (not garbage collection) can end it
    held = _validation_set(t, _read_held_out(t, gen))
    assert [int(b[0, 0]) for b in held] == [0, 1]
    assert pulled == [0, 1] and closed == [True]
    with pytest.raises(RuntimeError, match="held-out split has no blocks"):
        _validation_set(t, _read_held_out(t, iter(())))
    # A rank's share with fewer than val_batches micro-batches is an error, not a smaller validation.
    with pytest.raises(RuntimeError, match="holds only 1 micro-batch.*train.val_batches asks 2"):
        _validation_set(t, _read_held_out(t, iter([(torch.zeros(2, 5), [0, 1])])))
    model = Transformer(get_preset("tiny").replace(vocab_size=16, n_layers=1))
    first = _validate(model, contextlib.nullcontext(), held, torch.device("cpu"))
    assert first == _validate(model, contextlib.nullcontext(), held, torch.device("cpu")) and math.isfinite(first)


def test_adamw_is_fused_with_decoupled_decay_groups_but_for_fsdp_on_cpu():
    """Runs use the fused AdamW kernel (built here on CPU tensors for the GPU case: torch checks the flag, not the
    device, until the first step), on CPU too, since its found_inf lets a non-finite step be skipped on the device;
    FSDP on CPU keeps the default implementation."""
    cfg = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2, weight_decay=0.1)
    gpu = build_optimizer(small_model(), cfg, torch.device("cuda"))
    cpu = build_optimizer(small_model(), cfg, torch.device("cpu"))
    fsdp_cpu = build_optimizer(small_model(), dataclasses.replace(cfg, parallelism="fsdp"), torch.device("cpu"))
    assert isinstance(gpu, torch.optim.AdamW) and gpu.defaults["fused"] is True and cpu.defaults["fused"] is True
    assert not fsdp_cpu.defaults["fused"]
    assert [g["weight_decay"] for g in gpu.param_groups] == [0.1, 0.0]
    assert gpu.defaults["betas"] == (cfg.beta1, cfg.beta2) and gpu.defaults["eps"] == cfg.eps


def test_mfu_is_model_flops_per_token_times_tokens_per_s_over_the_configured_peak():
    from pipeline.train.loop import Interval, _interval_metrics

    model = Transformer(get_preset("tiny").replace(vocab_size=64, n_layers=1, max_seq_len=32))
    iv = Interval(start=time.perf_counter() - 2.0)  # 2 s ago
    for _ in range(4):
        iv.add(3.0, True, 0.1, 0.4)
    guard = NonFiniteGuard(3)
    t = TrainConfig(num_workers=2, global_batch=8, micro_batch=4, max_steps=10, warmup_steps=2,
                    peak_tflops_per_device=1e-6)
    m = _interval_metrics(iv, t, 4, 8 * 32, model.flops_per_token(32), 1e-3, 0.5, guard, torch.device("cpu"), model, 2)
    assert m["tokens_per_s"] == pytest.approx(4 * 8 * 32 / 2.0, rel=0.05)
    assert m["mfu"] == pytest.approx(model.flops_per_token(32) * m["tokens_per_s"] / (1e-6 * 1e12 * 2))
    assert m["data_wait_s"] == pytest.approx(0.1) and m["compute_s"] == pytest.approx(0.4)
    assert {"nsa/gate_cmp", "nsa/gate_slc", "nsa/gate_win", "nsa/sel_blocks", "nsa/sel_distance"} <= set(m)
    no_peak = _interval_metrics(iv, dataclasses.replace(t, peak_tflops_per_device=None), 4, 8 * 32,
                                model.flops_per_token(32), 1e-3, 0.5, guard, torch.device("cpu"), model, 2)
    assert "mfu" not in no_peak and "cudagraph_skips" not in m  # default compile mode: no CUDA graphs to skip


def test_under_cuda_graphs_the_metrics_count_graphs_inductor_ran_without_them(monkeypatch):
    from torch._dynamo.utils import counters

    from pipeline.train.loop import Interval, _interval_metrics

    model = Transformer(get_preset("tiny").replace(vocab_size=64, n_layers=1, max_seq_len=32))
    iv = Interval(start=time.perf_counter() - 1.0)
    iv.add(3.0, True, 0.1, 0.4)
    t = TrainConfig(num_workers=1, global_batch=4, micro_batch=4, max_steps=10, warmup_steps=2)
    monkeypatch.setattr(loop, "uses_cuda_graphs", lambda t: True)
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 2)
    m = _interval_metrics(iv, t, 1, 4 * 32, model.flops_per_token(32), 1e-3, 0.5, NonFiniteGuard(3),
                          torch.device("cpu"), model, 1)
    assert m["cudagraph_skips"] == 2


@pytest.mark.parametrize("log_checkpoints", [True, False])
def test_checkpoints_are_copied_to_the_mlflow_run_only_when_asked(tmp_path, log_checkpoints):
    """tracking.log_checkpoints: each checkpoint goes into the run's artifacts as checkpoints/step_<step>;
    off (the default), the run holds only where they are (its ray_train_run_dir tag)."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import RunLogger, TrackingConfig

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("ckpt", artifact_location=(tmp_path / "art").as_uri())).info.run_id
    cfg = TrackingConfig(tracking_uri=uri, system_metrics=False, log_checkpoints=log_checkpoints)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / ckpt.TRAIN_STATE).write_bytes(b"state")
    logger = RunLogger(cfg, uri, run_id)
    logger.log_checkpoint(str(checkpoint), 100)
    logger.close()
    logged = {a.path for a in client.list_artifacts(run_id, "checkpoints/step_00000100")}
    assert logged == ({f"checkpoints/step_00000100/{ckpt.TRAIN_STATE}"} if log_checkpoints else set())


def test_a_resumed_run_logs_each_step_once_and_marks_the_resume(tmp_path):
    """A restarted worker replays the steps between its checkpoint and where the lost attempt's log got: those
    are not logged twice; the resume is a point of `resumed_from_step`; new steps go on being logged."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import RunLogger, TrackingConfig

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("resume")).info.run_id
    cfg = TrackingConfig(tracking_uri=uri, system_metrics=False)
    lost = RunLogger(cfg, uri, run_id)
    for step in (1, 2, 3):
        lost.log_metrics({"train_loss": 10.0 - step, "lr": 0.1}, step=step)
    lost.close()  # the attempt dies here; its last checkpoint was step 1
    resumed = RunLogger(cfg, uri, run_id)
    resumed.log_resume(1)
    for step in (2, 3, 4):
        resumed.log_metrics({"train_loss": 20.0 - step, "lr": 0.2}, step=step)
    resumed.close()
    history = {h.step: h.value for h in client.get_metric_history(run_id, "train_loss")}
    assert len(client.get_metric_history(run_id, "train_loss")) == 4
    assert history == {1: 9.0, 2: 8.0, 3: 7.0, 4: 16.0}
    assert sorted(h.step for h in client.get_metric_history(run_id, "lr")) == [1, 2, 3, 4]
    assert [(h.step, h.value) for h in client.get_metric_history(run_id, "resumed_from_step")] == [(1, 1.0)]


def test_tracking_uri_from_config_then_environment_then_local_sqlite(tmp_path, monkeypatch):
    """Cluster jobs get the team server's URI from MLFLOW_TRACKING_URI (runtime env, KubeRay ConfigMap); an explicit
    tracking.tracking_uri wins; with neither, the local sqlite store under data.output_dir."""
    from pipeline.tracking import TrackingConfig, resolve_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(TrackingConfig(), str(tmp_path)) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert resolve_tracking_uri(TrackingConfig(), str(tmp_path)) == "http://mlflow.internal:5000"
    assert resolve_tracking_uri(TrackingConfig(tracking_uri="sqlite:///x.db"), str(tmp_path)) == "sqlite:///x.db"


def test_prepared_data_shares_are_checked_before_the_run(capsys):
    """Prepared data's block counts are known up front: a worker whose share of the held-out split cannot fill
    val_batches micro-batches is refused; a train share shorter than the run is announced (it will wrap)."""
    from pipeline.data.shards import Piece, Shares
    from pipeline.train.trainer import check_data_shares

    def shares(split, *sizes):
        ranks = tuple((Piece(f"{split}-{r}.parquet", 0, n, n, first_index=0),) for r, n in enumerate(sizes))
        return Shares(kind="prepared", split=split, world_size=len(sizes), pieces=sum(ranks, ()), ranks=ranks)

    job = load_job_config(None, ["train.num_workers=2", "train.global_batch=8", "train.micro_batch=4",
                                 "train.val_batches=2", "train.max_steps=10", "train.warmup_steps=1"])
    check_data_shares(job, {"train": shares("train", 40, 40), "val": shares("val", 8, 9)})  # 10 steps x 4 per worker
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=r"data.packed_dir: worker 1's share of the val split holds 7 blocks.*= 8"):
        check_data_shares(job, {"train": shares("train", 40, 40), "val": shares("val", 9, 7)})
    check_data_shares(job, {"train": shares("train", 40, 39), "val": shares("val", 8, 8)})
    assert "the run needs 40 train blocks per worker, the workers' shares hold [40, 39]" in capsys.readouterr().out


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_passes_preflight(path):
    """The configs the README and the GPU scripts run (e.g. CUDA graphs on 2 workers in nsa-125m-2gpu.yaml) are
    valid as shipped: a refused one would fail only on the GPU host."""
    job = load_job_config(str(path), [])
    preflight(job)
    assert job.train.max_steps > 0


def test_startup_splits_a_runs_first_seconds_into_its_phases(monkeypatch):
    """Each phase is the time since the one before; launch counts from the driver's clock; a step's phase also says
    how much of it went to waiting for its batches; a resumed run (no launch time) reports the worker's phases
    only."""
    clock = iter([100.0, 103.0, 110.0, 150.0, 151.5])
    monkeypatch.setattr(loop.time, "time", lambda: next(clock))
    startup = loop.Startup(launched_at=90.0)  # entered at 100
    for phase, wait in (("model", None), ("data", None), ("first_step", 8.25), ("second_step", 0.01)):
        startup.mark(phase, data_wait_s=wait)
    m = startup.metrics()
    assert m == {"startup_model_s": 3.0, "startup_data_s": 7.0, "startup_first_step_s": 40.0,
                 "startup_second_step_s": 1.5, "startup_launch_s": 10.0, "startup_total_s": 61.5,
                 "startup_first_step_data_wait_s": 8.25, "startup_second_step_data_wait_s": 0.01}
    assert startup.line() == ("startup: 61.5 s to the end of the second step (launch 10.0 s; model 3.0 s; "
                              "data 7.0 s; first_step 40.0 s (waiting for data 8.2 s); second_step 1.5 s (waiting "
                              "for data 0.0 s))")
    clock = iter([200.0, 204.0])
    resumed = loop.Startup(launched_at=None)
    resumed.mark("model")
    assert resumed.metrics() == {"startup_model_s": 4.0, "startup_total_s": 4.0}


_COMPILE_COUNTS = r"""
import json, sys
import triton, triton.language as tl
from torch._dynamo.utils import counters
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nsa_model.kernels.delta import row_dot_kernel
from pipeline.train import loop


@triton.jit
def not_nsa(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), 1.0)


def compile_for_h100(kernel, signature, constants):
    triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))


row_dot = {"DO": "*bf16", "O": "*bf16", "DELTA": "*fp32", "num_rows": "i32", "D": "constexpr",
           "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
triton.knobs.cache.dir = sys.argv[1]
heard = []
before = triton.knobs.compilation.listener = lambda **kw: heard.append(kw["cache_hit"])
counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"] = 5, 7  # earlier graphs
startup = loop.Startup(launched_at=None, compiles=loop.CompileCounts().start())
startup.mark("model")
for rows in (32, 64, 32):
    compile_for_h100(row_dot_kernel, row_dot, {"D": 64, "BLOCK_R": rows, "BLOCK_D": 64})
compile_for_h100(not_nsa, {"x_ptr": "*fp32", "N": "constexpr"}, {"N": 64})
counters["inductor"]["fxgraph_cache_hit"] += 2
counters["inductor"]["fxgraph_cache_miss"] += 1
startup.mark("first_step")
startup.compiles.stop()
print(json.dumps({"metrics": startup.metrics(), "line": startup.line(), "heard": heard,
                  "restored": triton.knobs.compilation.listener is before}))
"""


def test_startup_counts_the_nsa_kernels_compiled_and_inductors_graph_cache(tmp_path):
    """An NSA kernel compiled by Triton for an H100 at two tile sizes counts twice as compiled, one of them again
    (from Triton's on-disk cache) as cached, and a kernel from elsewhere not at all; FX graph cache hits and misses
    count from start() on; a listener set before keeps hearing every compilation and is set back by stop(). In a
    process of its own without TRITON_INTERPRET: the kernels must be Triton's compiled kind, not the interpreter's."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "compile_counts.py"  # a file: @triton.jit reads its function's source
    script.write_text(_COMPILE_COUNTS)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "triton")], capture_output=True, text=True,
                         env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    m = out["metrics"]
    assert out["heard"] == [False, False, True, False] and out["restored"]
    assert (m["startup_nsa_kernels_compiled"], m["startup_nsa_kernels_cached"]) == (2, 1)
    assert 0 < m["startup_nsa_compile_s"] < 60
    assert (m["startup_fxgraph_cache_hits"], m["startup_fxgraph_cache_misses"]) == (2, 1)
    assert m["startup_total_s"] == m["startup_model_s"] + m["startup_first_step_s"]  # the counts are not phases
    assert "s); NSA kernels: 2 compiled in " in out["line"]
    assert out["line"].endswith(" s, 1 from Triton's cache; inductor's FX graph cache: 2 hits, 1 misses")
