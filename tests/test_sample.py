"""Sampling from a trained model (nsa_model/generate.py, jobs/sample.py) and finding its weights
(pipeline/train/checkpoint.py): greedy steps against one forward pass, the context window, seeds, the stop token,
refused settings, and the job on checkpoint, run and model directories. jobs/sample.py on a real DDP run's
checkpoint is tested in tests/test_job_pretrain.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_model import generate as generate_module
from nsa_model.generate import generate, generate_samples, next_token
from nsa_model.model import Transformer
from pipeline.config import load_job_config
from pipeline.train import checkpoint as ckpt
from test_train_support import REPO

# the byte tokenizer (257 ids) needs no training; a small NSA model over it
JOB = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
       "model.vocab_size=260", "model.max_seq_len=32", "model.nsa.cmp_block=8", "model.nsa.cmp_stride=4",
       "model.nsa.sel_block=8", "model.nsa.n_selected=3", "model.nsa.window=8", "data.seq_len=32",
       "data.tokenizer=bytes"]


def small_job(seed: int = 0):
    """A small NSA model with every weight drawn at scale 0.3: as initialized (small weights, tied embeddings) it
    only repeats its last token, which would make a wrong context invisible."""
    job = load_job_config(None, JOB)
    torch.manual_seed(seed)
    model = Transformer(job.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return job, model


def test_greedy_steps_are_the_most_likely_tokens_of_one_forward_pass():
    """Causal model: the logits at position p of one pass over prompt + continuation are what step p saw."""
    _, model = small_job()
    prompt = [256, 72, 105, 33]
    new = generate(model, prompt, 12, temperature=0)
    assert len(new) == 12
    logits, _ = model(torch.tensor([prompt + new]))
    expected = logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    assert new == expected


def test_top_k_of_one_is_greedy_at_any_temperature():
    _, model = small_job(1)
    prompt = [256, 65]
    assert generate(model, prompt, 10, temperature=5.0, top_k=1) == generate(model, prompt, 10, temperature=0)


def test_a_context_past_max_seq_len_keeps_its_last_max_seq_len_tokens():
    _, model = small_job(2)
    prompt = [(7 * i) % 256 for i in range(29)]  # reaches max_seq_len = 32 at the fourth new token
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0][0].tolist()))
    new = generate(model, prompt, 8, temperature=0, use_cache=False)
    context = prompt + new
    assert seen == [context[:n][-32:] for n in range(len(prompt), len(context))]


def test_with_the_cache_each_step_sees_the_same_context(monkeypatch):
    """The cached path's calls: the prompt, then one token a call while the context has room, then the cropped
    context whole at every step (dropping the oldest token moves every position)."""
    _, model = small_job(2)
    prompt = [(7 * i) % 256 for i in range(29)]
    calls, cached = [], model.forward_cached

    def record(tokens, cache):
        calls.append((cache.length, tokens[0].tolist()))
        return cached(tokens, cache)
    monkeypatch.setattr(model, "forward_cached", record)
    new = generate(model, prompt, 8, temperature=0)
    context = prompt + new
    assert [held for held, _ in calls] == [0, 29, 30, 31, 0, 0, 0, 0]
    seen, view = [], []
    for held, tokens in calls:
        view = view + tokens if held else tokens
        seen.append(view)
    assert seen == [context[:n][-32:] for n in range(len(prompt), len(context))]


def float64_model(attention: str, seed: int = 5):
    job = load_job_config(None, JOB + [f"model.attention={attention}"])
    torch.manual_seed(seed)
    model = Transformer(job.model).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_the_cache_gives_the_tokens_of_the_whole_context_pass(attention):
    """Greedy and seeded draws, in float64 (no near-ties between the two paths' roundings), past max_seq_len."""
    model = float64_model(attention)
    prompt = [256, 84, 104, 101]
    greedy = generate(model, prompt, 40, temperature=0)
    assert len(set(greedy)) >= 5
    assert greedy == generate(model, prompt, 40, temperature=0, use_cache=False)

    def draw(use_cache):
        return generate(model, prompt, 40, temperature=1.0, top_k=20, use_cache=use_cache,
                        generator=torch.Generator().manual_seed(7))
    assert draw(True) == draw(False)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_samples_drawn_together_each_see_their_own_context(attention, monkeypatch):
    """generate_samples' rows: the prompt once, copied to every row, then batched steps, past max_seq_len (where
    the cropped rows, now different, run whole). Every logit row each step drew from must be that row's own
    context through one forward pass of a single row (a cache row shared, mixed or left stale fails), and the
    draws must be those of the whole-context path."""
    model = float64_model(attention)
    drawn_from, real = [], generate_module.next_tokens

    def record(logits, *args):
        drawn_from.append(logits.clone())
        return real(logits, *args)
    monkeypatch.setattr(generate_module, "next_tokens", record)
    prompt = [256, 84, 104, 101]

    def draw(use_cache):
        return generate_samples(model, prompt, 36, 4, temperature=1.0, top_k=20, use_cache=use_cache,
                                generator=torch.Generator().manual_seed(7))
    samples = draw(True)
    assert len({tuple(row) for row in samples}) == 4 and all(len(row) == 36 for row in samples)
    for r, row in enumerate(samples):
        context = prompt + row
        for i, logits in enumerate(drawn_from):
            alone, _ = model(torch.tensor([context[:len(prompt) + i][-32:]]))
            # generate draws from float32 logits: the float64 model's, rounded once
            assert torch.allclose(logits[r].double(), alone[0, -1], rtol=1e-6, atol=1e-6), (r, i)
    assert draw(False) == samples


def test_each_sample_stops_at_its_own_stop_token_and_the_others_go_on():
    _, model = small_job(3)
    prompt = [256, 104, 105]

    def draw(**kw):
        return generate_samples(model, prompt, 20, 6, temperature=1.0, generator=torch.Generator().manual_seed(0),
                                **kw)
    free = draw()
    stop = free[0][3]
    stopped = draw(stop_id=stop)
    for row, whole in zip(stopped, free, strict=True):  # each row the same draws up to its own first stop
        end = whole.index(stop) + 1 if stop in whole else len(whole)
        assert row == whole[:end]
    assert len(stopped[0]) <= 4 and max(len(row) for row in stopped) > len(stopped[0])


def test_a_cache_repeats_only_a_one_row_prompt_into_buffers_of_each_row():
    _, model = small_job()
    cache = model.new_cache()
    with pytest.raises(ValueError, match="needs a cache holding a one-row prompt, this one holds 0 positions"):
        cache.repeat_rows(2)
    two = model.new_cache()
    model.forward_cached(torch.tensor([[256, 65], [256, 66]]), two)
    with pytest.raises(ValueError, match="holds 2 positions of 2 rows"):
        two.repeat_rows(4)
    model.forward_cached(torch.tensor([[256, 65, 66]]), cache)
    with pytest.raises(ValueError, match="rows must be an int >= 1, got 0"):
        cache.repeat_rows(0)
    cache.repeat_rows(3)
    assert cache.batch == 3
    for layer in cache.layers:
        for x in layer.raw + layer.compressed:
            assert x.shape[0] == 3 and x.is_contiguous() and torch.equal(x[0], x[2])
    layer = cache.layers[0].raw[0]
    layer[1].add_(1.0)
    assert not torch.equal(layer[0], layer[1])  # each row its own buffer: a row's writes stay its own
    with pytest.raises(ValueError, match="the cache holds 3 rows"):
        model.forward_cached(torch.tensor([[65]]), cache)


def test_draws_repeat_with_a_seed_and_stop_after_the_stop_token():
    _, model = small_job(3)
    prompt = [256, 104, 105]

    def draw(seed, **kw):
        return generate(model, prompt, 20, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)
    assert draw(0) == draw(0)
    assert draw(0) != draw(1)  # 20 draws from near-uniform logits over 260 tokens
    stop = draw(0)[4]
    stopped = draw(0, stop_id=stop)
    assert stopped[-1] == stop and stop not in stopped[:-1] and len(stopped) <= 5


def test_only_ids_of_the_tokenizer_come_out_of_a_padded_vocabulary():
    """The model has 260 rows, the byte tokenizer 257 ids: rows 257-259, made the most likely, never come out."""
    _, model = small_job(7)

    def padded_rows_win(module, inputs, logits):
        return logits + torch.cat([logits.new_zeros(257), logits.new_full((3,), 1e4)])
    model.lm_head.register_forward_hook(padded_rows_win)
    prompt = [256, 65, 66]
    assert min(generate(model, prompt, 8, temperature=0)) >= 257  # without the limit
    for kw in (dict(temperature=0), dict(temperature=1.0, generator=torch.Generator().manual_seed(0))):
        assert max(generate(model, prompt, 8, vocab_size=257, **kw)) < 257


def test_draws_keep_to_the_top_k_and_follow_the_temperature():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(8)) * 3
    top5 = set(torch.topk(logits, 5).indices.tolist())
    gen = torch.Generator().manual_seed(9)

    def draws(temperature, top_k=None, n=300):
        return [next_token(logits, temperature, top_k, gen) for _ in range(n)]
    in_top5 = draws(1.0, top_k=5)
    assert set(in_top5) <= top5 and len(set(in_top5)) >= 3
    argmax = int(logits.argmax())
    cold, hot = draws(0.05), draws(20.0)
    assert cold.count(argmax) == len(cold)  # the top logit leads the next by more than 0.05 x 20
    assert len(set(hot)) > 40 and hot.count(argmax) < 30  # near uniform over 100 ids
    assert draws(1e-40, n=5) == [argmax] * 5  # no overflow to NaN


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=-1), "max_new_tokens: must be an int >= 0"),
    (dict(temperature=-0.5), "temperature: must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature: must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature: must be a finite number >= 0"),
    (dict(top_k=True), "top_k: must be an int >= 1 or None"),
    (dict(top_k=0), "top_k: must be an int >= 1 or None"),
    (dict(prompt=[]), "prompt: needs at least one token"),
    (dict(prompt=[256, 300]), "prompt: token ids [300] are outside the model's vocabulary of 260"),
    (dict(vocab_size=261), "vocab_size: must be in 1..260"),
    (dict(samples=0), "samples: must be an int >= 1, got 0"),
    (dict(samples=2.0), "samples: must be an int >= 1, got 2.0")])
def test_settings_that_cannot_sample_are_refused(kwargs, message):
    _, model = small_job()
    args = dict(prompt=[256], max_new_tokens=3, samples=1, temperature=1.0, top_k=None, vocab_size=None) | kwargs
    with pytest.raises(ValueError) as err:
        generate_samples(model, args.pop("prompt"), args.pop("max_new_tokens"), args.pop("samples"), **args)
    assert message in str(err.value)


def save_checkpoint(directory: Path, job, model, step: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ckpt.save(directory, rank=0, model=model, optimizer=opt, scheduler=sched,
              position=ckpt.TrainingPosition(step=step, rank_blocks=step, world_size=1, guard={}),
              config_yaml=job.to_yaml())


def test_a_run_directory_gives_its_latest_checkpoint_and_a_model_directory_its_weights(tmp_path):
    job, early = small_job(4)
    _, late = small_job(5)
    save_checkpoint(tmp_path / "run" / "checkpoint_step_00000009", job, early, 9)
    save_checkpoint(tmp_path / "run" / "checkpoint_step_00000010", job, late, 10)  # sorts after step 9
    directory = ckpt.trained_model_dir(tmp_path / "run")
    assert directory.name == "checkpoint_step_00000010"
    assert ckpt.trained_model_dir(directory) == directory
    weights = ckpt.load_trained_weights(directory)
    assert all(torch.equal(weights[k], v) for k, v in late.state_dict().items())
    model_dir = tmp_path / "model"  # as the run logs its final model to MLflow
    model_dir.mkdir()
    torch.save(late.state_dict(), model_dir / ckpt.MODEL_FILE)
    (model_dir / ckpt.CONFIG_FILE).write_text(job.to_yaml())
    assert ckpt.trained_model_dir(model_dir) == model_dir
    assert all(torch.equal(ckpt.load_trained_weights(model_dir)[k], v) for k, v in late.state_dict().items())


@pytest.mark.parametrize("layout,message", [
    ("missing", "not a directory"), ("empty", "holds neither train_state.pt, model.pt nor any checkpoint_step_"),
    ("no_config", "has no config.yaml")])
def test_a_directory_without_a_model_is_refused(tmp_path, layout, message):
    source = tmp_path / "src"
    if layout != "missing":
        source.mkdir()
    if layout == "no_config":
        torch.save({}, source / ckpt.MODEL_FILE)
    with pytest.raises(FileNotFoundError, match=message):
        ckpt.trained_model_dir(source)


def run_sample(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/sample.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_sample_job_continues_a_prompt_from_a_checkpoint(tmp_path):
    job, model = small_job(6)
    with torch.no_grad():  # the 3 rows past the byte tokenizer's 257 would win most steps (their text: none)
        model.lm_head.weight[257:] *= 100
    save_checkpoint(tmp_path / "checkpoint_step_00000003", job, model, 3)
    proc = run_sample(str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "6", "--temperature", "0",
                      "--samples", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"model: {tmp_path / 'checkpoint_step_00000003'}" in out and "tokenizer: bytes" in out
    new = generate(model, [256, 72, 105], 6, temperature=0, stop_id=256, vocab_size=257)  # EOS, then "Hi"
    assert new != generate(model, [72, 105], 6, temperature=0, stop_id=256, vocab_size=257)  # EOS first matters
    text = bytes(i for i in new if i < 256).decode("utf-8", errors="replace")
    ending = "[end of document]" if new[-1] == 256 else f"[{len(new)} tokens]"
    samples = out.split("--- sample ")[1:]
    assert len(samples) == 2
    for i, sample in enumerate(samples):  # greedy: both the same, and what generate gives in this process
        assert sample == f"{i + 1} of 2 ---\nHi{text} {ending}\n"


def test_sample_job_refuses_what_it_cannot_run_before_loading(tmp_path):
    proc = run_sample(str(tmp_path), "--temperature", "-1")
    assert proc.returncode == 2 and "temperature: must be a finite number >= 0" in proc.stderr
    proc = run_sample(str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    job, model = small_job()
    big = load_job_config(None, [*JOB[:5], "model.vocab_size=200", *JOB[6:]])  # fewer ids than the byte tokenizer
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "small", big, Transformer(big.model), 1)
    proc = run_sample(str(tmp_path / "small"), "--device", "cpu")
    assert proc.returncode == 2 and "has 257 tokens, more than the model's 200" in proc.stderr


def sample_main():
    """jobs/sample.py's main, imported from its path (jobs/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nsa_sample_job", REPO / "jobs" / "sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_sample_job_draws_repeat_with_its_seed(tmp_path, capsys):
    job, model = small_job(10)
    save_checkpoint(tmp_path / "ckpt", job, model, 1)
    main = sample_main()

    def texts(seed, *more):
        assert main([str(tmp_path / "ckpt"), "--max-new-tokens", "12", "--temperature", "1", "--samples", "2",
                     "--seed", str(seed), "--device", "cpu", *more]) == 0
        return capsys.readouterr().out.split("--- sample ")[1:]
    first = texts(5)
    assert first == texts(5) and first != texts(6)
    assert first[0] != first[1]  # the samples of one run draw on
    assert texts(5, "--no-cache") == first  # the whole context a token: the same draws


def test_sample_job_never_trains_a_tokenizer_and_takes_one_given(tmp_path, capsys):
    """A run on the embedded tokenizer whose file is not where training left it (a checkpoint copied elsewhere):
    refused, with the way out; --tokenizer then gives the file."""
    from pipeline.data.tokenizer import train_bpe

    job = load_job_config(None, [*JOB[:5], "model.vocab_size=300", *JOB[6:-1], "data.tokenizer=embedded",
                                 f"data.output_dir={tmp_path / 'outputs'}"])
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", job, Transformer(job.model), 1)
    main = sample_main()
    assert main([str(tmp_path / "ckpt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"the run's tokenizer is not at {tmp_path / 'outputs' / 'tokenizer'}" in err and "--tokenizer" in err
    assert not (tmp_path / "outputs").exists()  # nothing was trained
    bpe = train_bpe(iter(["hello world, hello tokenizer"] * 20), 300, tmp_path / "tok" / "tokenizer.json")
    assert main([str(tmp_path / "ckpt"), "--tokenizer", str(bpe), "--prompt", "hello", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
    assert f"tokenizer: {bpe}" in capsys.readouterr().out


@pytest.mark.parametrize("case,message", [
    ("device_word", "--device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("device_absent", "--device cuda:7: this machine has"),
    ("torn_latest", "checkpoint_step_00000002: the latest checkpoint of"),
    ("torn_weights", "its weights do not load into the model its config.yaml describes"),
    ("other_model", "its weights do not load into the model its config.yaml describes")])
def test_sample_job_refuses_a_device_or_weights_it_cannot_use(tmp_path, capsys, case, message):
    job, model = small_job()
    save_checkpoint(tmp_path / "checkpoint_step_00000001", job, model, 1)
    device = {"device_word": "gpu", "device_absent": "cuda:7"}.get(case, "cpu")
    if case == "torn_latest":  # a copy cut short: its config came, its weights did not
        (tmp_path / "checkpoint_step_00000002").mkdir()
        (tmp_path / "checkpoint_step_00000002" / ckpt.CONFIG_FILE).write_text(job.to_yaml())
    if case == "torn_weights":
        (tmp_path / "checkpoint_step_00000001" / ckpt.TRAIN_STATE).write_bytes(b"not a torch file")
    if case == "other_model":
        other = load_job_config(None, [*JOB, "model.n_layers=3"])
        (tmp_path / "checkpoint_step_00000001" / ckpt.CONFIG_FILE).write_text(other.to_yaml())
    assert sample_main()([str(tmp_path), "--device", device]) == 2
    assert message in capsys.readouterr().err
