"""bf16 checks of the Triton backend on the GPU, up to T = 128k, against a float64 reference computed on the GPU in
query chunks (the checks of bench/kernels.py). Skipped where there is no CUDA; CI has none.

bench/kernels.py is loaded only inside the test: importing it imports the compiled backend, which a CPU-only
session must not do before test_triton_kernels.py imports the interpreted one.
"""

import importlib.util
import itertools
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 large-T checks need a CUDA GPU")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernels.py")
N_CHECKS = 21  # len(bench/kernels.py CHECKS)


def _bench_module():
    spec = importlib.util.spec_from_file_location("nsa_bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("index", range(N_CHECKS))
def test_bf16_matches_float64_reference(index):
    bench = _bench_module()
    assert len(bench.CHECKS) == N_CHECKS
    name, cfg, case = bench.check_case(bench.CHECKS[index])
    result = bench.check_bf16(name, cfg=cfg, **case)
    assert result["finite"], result
    assert result["selection_rows_differing"] == result["selection_near_ties"], result  # only near-ties may differ
    errors = {k: v for k, v in result.items() if k == "o" or (k.startswith("d") and k[1:] in bench.NAMES)}
    assert max(errors.values()) <= bench.BF16_TOL, errors


def test_core_on_two_streams_matches_one_stream_eager_and_in_a_cuda_graph():
    """side_stream runs the window forward and the range dK/dV on a second stream (ops/triton_impl.py, _Beside):
    the output and every gradient must equal the one-stream run's, called eagerly and replayed as a CUDA graph
    (the graph joins both streams' launches), at a shape where by_block runs (125m, 2 x 4096). Gradients from
    atomics differ in summation order only: within 1e-3 of the norm."""
    bench = _bench_module()
    ti = bench.ti
    cfg = bench.PAPER_NSA
    # All of it off the legacy default stream: autograd keeps the stream each leaf was first used on and waits on
    # it at the end of a backward, which a capture may not do with the default stream (pytorch/pytorch#164302).
    with torch.cuda.stream(torch.cuda.Stream()):
        x = bench.make_inputs(2, 4096, 12, 2, 64, 64, cfg, torch.bfloat16, seed=3)
        leaves = [x[n].requires_grad_() for n in bench.NAMES]
        do = torch.randn(2, 4096, 12, 64, device="cuda", dtype=torch.bfloat16)

        def call():
            o = ti.nsa_attention(*leaves, cfg, scale=0.125)
            return [o, *torch.autograd.grad(o, leaves, do)]

        with ti.use_launch_config(ti.LaunchConfig(side_stream=False)):
            expected = call()
        with ti.use_launch_config(ti.LaunchConfig(side_stream=True)):
            eager = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = call()
            for t in replayed:
                t.zero_()
            graph.replay()
        torch.cuda.synchronize()
    for name, want, got_eager, got_graph in zip(("o", *bench.NAMES), expected, eager, replayed):
        for got in (got_eager, got_graph):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= 1e-3, (name, err)
    assert torch.equal(eager[0], expected[0])  # the forward has no atomics: the same bits


def test_attention_recompute_keeps_less_by_what_it_recomputes_and_gives_the_same_gradients():
    """One nsa-125m layer at 8k tokens in bf16 on the GPU: with recompute the memory held between forward and
    backward drops by at least q, the six K/V sets and the compressed and window outputs (48 MiB), the output is
    bit for bit that of the layer that keeps them, and the gradients are too up to the order of atomic adds (the
    dK/dV kernels of the compressed and window branches add across programs, and a gradient element that lands
    on the other side of a bf16 rounding moves by an ulp). Each gradient may move by two bf16 ulps (2^-7) relative
    to its norm, or by three times the largest difference among three runs of the layer that keeps them. The
    floor is measured (bench/results/probe-recompute-noise-h200-2026-11-30-v65a.md, five runs each way): the order
    alone moves phi_k.fc2.bias, a sum over every compressed token whose terms nearly cancel (norm 5e-10), by up to
    4.1e-3 between kept runs and 4.5e-3 against a recomputing one, past one ulp (3.9e-3); with a single pair of
    kept runs as the yardstick that failed once in 18 full-file runs (kernels-notes v64). A recompute that gets a
    gradient wrong moves it by its own size."""
    from nsa_model import get_preset
    from nsa_model.attention import NSAAttention

    cfg, T = get_preset("nsa-125m").replace(max_seq_len=8192), 8192
    x = torch.randn(1, T, cfg.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for recompute in (False, False, False, True):
        torch.manual_seed(0)
        layer = NSAAttention(cfg, recompute=recompute).cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.float().square().mean().backward()
        results.append((held, out.detach(), {n: p.grad for n, p in layer.named_parameters()}))
    (held_kept, out_kept, grads_kept), *again, (held_less, out_less, grads_less) = results
    kept_runs = [grads_kept] + [grads for _, _, grads in again]
    H, G, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert held_kept - held_less >= T * (3 * H + 6 * G) * D * 2, (held_kept, held_less)
    assert torch.equal(out_kept, out_less), f"outputs differ by up to {(out_kept - out_less).abs().max().item():.2e}"

    def rel(a, b):
        return ((a - b).norm() / a.norm()).item()
    for name, grad in grads_kept.items():
        noise = max(rel(a[name], b[name]) for a, b in itertools.combinations(kept_runs, 2))
        moved = rel(grad, grads_less[name])
        assert moved <= max(2 ** -7, 3 * noise), f"{name}: moved {moved:.2e} by recompute, {noise:.2e} between runs"


@pytest.mark.parametrize("slc_kernel", ["auto", "tiled"])  # auto runs per_query at this T
def test_query_dq_from_stored_ds_past_int32_offsets_equals_recompute(slc_kernel):
    """slc_query_dq="ds" stores by_block's ds at every (query, group, slot, head) row, 64 wide: 65,536 elements a
    query at the paper shapes, so past T = 32,768 the ds tensor holds more than 2^31 elements and its offsets
    must be int64 in by_block's store and in both dQ kernels that read it. No float64 reference fits there with
    gradients; the judge is the recompute path (checked against the reference at every other shape), run on the
    same inputs: each gradient within 1e-2 of its norm (ds is rounded to bf16 before its product; a wrapped
    offset reads another query's ds and moves the rows past 2^31 by their whole size)."""
    bench = _bench_module()
    ti = bench.ti
    cfg = bench.PAPER_NSA
    B, T, H, G, D = 1, 36864, 64, 4, 128
    ds_per_query = G * cfg.n_selected * (H // G) * cfg.sel_block
    assert B * T * ds_per_query >= 2 ** 31
    x = bench.make_inputs(B, T, H, G, D, D, cfg, torch.bfloat16, seed=5)
    leaves = [x[n].requires_grad_() for n in bench.NAMES]
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(6))
    results = {}
    for query_dq in ("recompute", "ds"):
        with ti.use_launch_config(ti.LaunchConfig(slc_kernel=slc_kernel, slc_query_dq=query_dq)):
            o = ti.nsa_attention(*leaves, cfg, scale=D ** -0.5)
            results[query_dq] = [o.detach(), *torch.autograd.grad(o, leaves, do)]

    def rel(got, want):
        return ((got.float() - want.float()).norm() / want.float().norm()).item()
    for name, want, got in zip(("o", *bench.NAMES), results["recompute"], results["ds"]):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) <= 1e-2, (name, rel(got, want))
    # dq's rows past 2^31 ds elements on their own: a wrapped offset there would not hide in the norm above
    first = -(-(2 ** 31) // ds_per_query)
    tail_err = rel(results["ds"][1][:, first:], results["recompute"][1][:, first:])
    assert tail_err <= 1e-2, tail_err


def _decode_kernel(name):
    """A launch config with LaunchConfig.decode_kernel = name, for a `with` block."""
    import dataclasses

    from nsa_model.ops import triton_impl

    return triton_impl.use_launch_config(dataclasses.replace(triton_impl.launch_config(), decode_kernel=name))


def _sampling_model():
    """(float32 nsa-125m of 2 layers on the CPU, an 8-token prompt) for the sampling tests: weights drawn at 0.05,
    since as initialized a model repeats its last token whatever its attention does."""
    from nsa_model import get_preset
    from nsa_model.model import Transformer

    cfg = get_preset("nsa-125m").replace(n_layers=2, max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    prompt = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    return model, prompt


@pytest.mark.parametrize("decode_kernel", ["torch", "triton"])
def test_greedy_sampling_on_the_gpu_follows_the_float32_model(decode_kernel):
    """jobs/sample.py's path on a GPU: nsa_model/generate.py with the Triton kernels under bf16 autocast, on a
    context that grows a token at a time from 8 tokens (under one compressed block) past two selection blocks.
    Every token it picks must be the float32 model's most likely one on the CPU, up to bf16 noise: within 2% of
    the logits' range of the top (a wrong attention picks tokens far down the list). Seeded draws repeat."""
    from nsa_model.generate import generate

    model, prompt = _sampling_model()
    with torch.autocast("cuda", dtype=torch.bfloat16), _decode_kernel(decode_kernel):
        new = generate(model.cuda(), prompt, 140, temperature=0)
    logits, _ = model.cpu()(torch.tensor([prompt + new]))
    steps = logits[0, len(prompt) - 1:-1].double()
    chosen = steps.gather(1, torch.tensor(new)[:, None])[:, 0]
    gap = (steps.max(1).values - chosen) / (steps.max(1).values - steps.min(1).values)
    assert len(set(new)) >= 5, new  # not one token repeated: the context moves the choice
    assert gap.max().item() <= 0.02, (gap.max().item(), int(gap.argmax()))
    # draws on the GPU's own generator repeat with its seed (jobs/sample.py --seed)
    with torch.autocast("cuda", dtype=torch.bfloat16), _decode_kernel(decode_kernel):
        drawn = [generate(model.cuda(), prompt, 30, temperature=1.0, top_k=50,
                          generator=torch.Generator("cuda").manual_seed(seed)) for seed in (3, 3, 4)]
    assert drawn[0] == drawn[1] != drawn[2]


@pytest.mark.parametrize("decode_kernel", ["torch", "triton"])
def test_samples_drawn_together_on_the_gpu_each_follow_their_own_context(decode_kernel, monkeypatch):
    """generate_samples on the GPU under bf16: the prompt once, its cache copied to 4 rows, then each step of all
    the rows from its kind's CUDA graph, from 8 tokens past two selection blocks. The logits every row drew from,
    at every step, against the float32 model on the CPU over that row's own tokens, as a fraction of the logits'
    range: bf16 noise, where a row reading another's cache, or a stale one, is off by the whole range."""
    from nsa_model import generate as generate_module

    model, prompt = _sampling_model()
    drawn_from, real = [], generate_module.next_tokens

    def record(logits, *args):
        drawn_from.append(logits.float().cpu())
        return real(logits, *args)
    monkeypatch.setattr(generate_module, "next_tokens", record)
    with torch.autocast("cuda", dtype=torch.bfloat16), _decode_kernel(decode_kernel):
        samples = generate_module.generate_samples(model.cuda(), prompt, 140, 4, temperature=1.0, top_k=50,
                                                   generator=torch.Generator("cuda").manual_seed(3))
    assert len({tuple(row) for row in samples}) == 4 and all(len(row) == 140 for row in samples)
    stepped = torch.stack(drawn_from, dim=1).double()  # [4 rows, 140 steps, vocab]
    model.cpu()
    for r, row in enumerate(samples):
        with torch.no_grad():
            logits, _ = model(torch.tensor([prompt + row]))
        want = logits[0, len(prompt) - 1:-1].double()
        error = (stepped[r] - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))
        assert error.median() <= 1e-2 and error.max() <= 5e-2, (r, error.median().item(), error.max().item())


# NSA settings of the decoding test besides nsa-125m's own: the tiny preset's, and a Tune sweep's pick with n padded
# to 8 and a window that is no power of two (cmp_block, cmp_stride, sel_block, n_selected, window)
OTHER_DECODING_NSA = {"tiny": (16, 8, 16, 4, 64), "cmp64_n5_w200": (64, 32, 64, 5, 200)}


@pytest.mark.parametrize("decode_kernel,nsa", [("torch", None), ("triton", None)]
                         + [("triton", name) for name in OTHER_DECODING_NSA])
def test_nsa_decoding_steps_on_the_gpu_give_the_layer_s_full_pass(decode_kernel, nsa):
    """NSAAttention.prefill + decode under bf16 on the GPU: a 600-token prompt through the Triton core (past
    w = 512 and nine selection blocks), then 100 decoding steps (ops/decode.py, phi and RoPE through our kernels)
    over the layer's cache, against one forward over all 700 positions. Per position, the error as a fraction of
    that output's largest value: bf16 and near-ties in the selection let a few positions differ, the median must
    not. Also at other NSA settings (OTHER_DECODING_NSA), each with more blocks at 600 tokens than it selects."""
    from nsa_model import get_preset
    from nsa_model.attention import NSAAttention
    from nsa_model.cache import LayerCache
    from nsa_model.config import NSAConfig

    cfg = get_preset("nsa-125m")
    if nsa is not None:
        fields = dict(zip(("cmp_block", "cmp_stride", "sel_block", "n_selected", "window"), OTHER_DECODING_NSA[nsa]))
        cfg = cfg.replace(nsa=NSAConfig(**fields))
        assert 600 // cfg.nsa.sel_block > cfg.nsa.n_selected  # the top-n chooses
    torch.manual_seed(0)
    layer = NSAAttention(cfg).cuda().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    x = torch.randn(1, 700, cfg.dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cache = LayerCache()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), _decode_kernel(decode_kernel):
        full = layer(x)[0].double()
        layer.prefill(x[:, :600], cache, capacity=1024)
        steps = torch.cat([layer.decode(x[:, t:t + 1], cache, torch.tensor([t], device="cuda"),
                                        cfg.nsa.ends_cmp_token(t)) for t in range(600, 700)], dim=1)[0].double()
    error = (steps - full[600:]).abs().amax(-1) / full[600:].abs().amax(-1)
    assert error.median() <= 1e-2, error.tolist()
    assert (error > 5e-2).sum() <= 5, error.tolist()


@pytest.mark.parametrize("decode_kernel", ["torch", "triton"])
def test_decoding_steps_replayed_from_a_cuda_graph_are_the_eager_steps(decode_kernel):
    """generate()'s DecodingSteps on the GPU: the first step of each kind eager (one that ends a compressed
    token, one that does not), then that kind's captured CUDA graph replayed with each step's token and
    position. Its logits against eager forward_cached steps on a second cache, same tokens: the same kernels on
    the same data, so equal up to the order of floating-point sums."""
    from nsa_model import get_preset
    from nsa_model.generate import DecodingSteps
    from nsa_model.model import Transformer

    cfg = get_preset("nsa-125m").replace(n_layers=2, max_seq_len=1024)
    torch.manual_seed(0)
    model = Transformer(cfg).eval().cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    tokens = torch.randint(0, cfg.vocab_size, (1, 700), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), _decode_kernel(decode_kernel):
        graphed, eager = DecodingSteps(model), model.new_cache()
        model.forward_cached(tokens[:, :600], graphed.cache)
        model.forward_cached(tokens[:, :600], eager)
        replayed = [graphed(tokens[:, t:t + 1]).clone() for t in range(600, 700)]
        stepped = [model.forward_cached(tokens[:, t:t + 1], eager) for t in range(600, 700)]
    assert set(graphed.graphs) == {False, True} and graphed.cache.length == eager.length == 700  # both kinds
    replayed, stepped = torch.cat(replayed, 1)[0].float(), torch.cat(stepped, 1)[0].float()
    assert (replayed - stepped).abs().max() <= 1e-3 * (stepped.max() - stepped.min())
