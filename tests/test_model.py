"""The attention modules and the decoder: init loss, overfitting, causality, backends, compile, accounting."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_model import ModelConfig, NSAConfig, Transformer, get_preset, ops
from nsa_model.attention import NSAAttention, project_qkv
from nsa_model.model import _mean_keys_per_query

SMALL_NSA = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6)


def small_cfg(attention="nsa", **kw) -> ModelConfig:
    base = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64,
                attention=attention, nsa=SMALL_NSA)
    return ModelConfig(**{**base, **kw})


def tokens(cfg, B, T, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense"])
def test_loss_at_init_is_about_ln_vocab(preset):
    cfg = get_preset(preset).replace(n_layers=2)
    torch.manual_seed(0)
    x = tokens(cfg, 2, 64)
    with torch.no_grad():
        logits, loss = Transformer(cfg)(x[:, :-1], x[:, 1:])
    assert logits.shape == (2, 64, cfg.vocab_size)
    assert abs(loss.item() / math.log(cfg.vocab_size) - 1) < 0.05


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_tiny_model_overfits_one_batch(attention):
    cfg = small_cfg(attention)
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x = tokens(cfg, 4, 32)
    first = None
    for _ in range(300):
        _, loss = model(x[:, :-1], x[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.1 * first:
            break
    assert loss.item() < 0.1 * first, f"loss {first:.3f} -> {loss.item():.3f}"


@pytest.mark.parametrize("overrides", [dict(phi="mlp"), dict(phi="avg", shared_kv=True), dict(v_head_dim=8),
                                       dict(attention="dense")])
def test_model_is_causal_through_compression_and_selection(overrides):
    cfg = small_cfg(**overrides)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    x = tokens(cfg, 2, 40)[:, :-1]
    t0 = 20  # the compressed token [18, 22) straddles t0
    y = x.clone()
    y[:, t0 + 1:] = (y[:, t0 + 1:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(y)
    assert torch.allclose(a[:, : t0 + 1], b[:, : t0 + 1], rtol=0, atol=1e-10)
    assert not torch.allclose(a[:, t0 + 1:], b[:, t0 + 1:])


@pytest.mark.parametrize("overrides", [dict(phi="mlp"), dict(phi="avg", shared_kv=True, v_head_dim=8)])
def test_nsa_module_torch_backend_matches_naive(overrides):
    cfg = small_cfg(**overrides)
    torch.manual_seed(0)
    x = torch.randn(2, 27, cfg.dim, dtype=torch.float64)
    results = {}
    for backend in ("naive", "torch"):
        torch.manual_seed(1)
        attn = NSAAttention(cfg, backend=backend).double()
        out = attn(x)
        out.square().sum().backward()
        results[backend] = (out.detach(), {n: p.grad for n, p in attn.named_parameters()})
    out_ref, grads_ref = results["naive"]
    out, grads = results["torch"]
    assert torch.allclose(out, out_ref, rtol=1e-9, atol=1e-12)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name] is not None, name
        assert torch.allclose(grads[name], grads_ref[name], rtol=1e-8, atol=1e-12), name


@pytest.mark.parametrize("attention, fused_gate", [("nsa", False), ("nsa", True), ("dense", False)])
def test_fused_qkv_projection_gives_the_unfused_outputs_and_gradients(attention, fused_gate):
    """fused_qkv computes q, k, v in one matmul of the concatenated weights (with fused_gate NSA's gate weight
    too, and rows of zeros up to a width of a multiple of 64: q 64 + K 96 + V 96 + 12 gate columns here, 52 rows
    of zeros up to 320): same values and parameter gradients as separate Linears, in float64, and the same
    parameter names (checkpoints do not depend on it). q, K and V each come out as a tensor of their own."""
    x = torch.randn(2, 27, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = {}
    for fused in (False, True):  # unfused, the gate is its own Linear whatever fused_gate says
        cfg = small_cfg(attention, fused_qkv=fused, fused_gate=fused_gate)
        torch.manual_seed(1)
        model = Transformer(cfg, backend="torch").double()
        attn = model.blocks[0].attn
        out = attn(x)
        out.square().sum().backward()
        results[fused] = out.detach(), {n: p.grad for n, p in attn.named_parameters()}
    (out_ref, grads_ref), (out, grads) = results[False], results[True]
    sets = attn.kv_sets if attention == "nsa" else 1
    parts = project_qkv(x, attn.wq, attn.wk, attn.wv, attn.rope, cfg, sets, "torch")
    assert len(parts) == 1 + 2 * sets
    # each its own tensor: attention keeps k and v for the backward, a view would keep all of q|k|v
    assert all(part._base is None for part in parts)
    assert torch.allclose(out, out_ref, rtol=1e-10, atol=1e-12)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert torch.allclose(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12), name
    attn.float()  # last: this converts the layer in place
    with torch.autocast("cpu", dtype=torch.bfloat16):  # every part, gate logits too, in the autocast dtype
        parts = project_qkv(x.float(), attn.wq, attn.wk, attn.wv, attn.rope, cfg, sets, "torch",
                            gate=attn.gate if attention == "nsa" else None)
    assert {part.dtype for part in parts} == {torch.bfloat16}


def test_compiled_model_matches_eager():
    # The tiny preset itself (all its layers, at a short T): fullgraph=True makes any host sync or untraceable
    # Python in the forward or backward an error. aot_eager keeps the test fast (dynamo and AOT autograd trace
    # the same graphs inductor would get; inductor's C++ codegen on CPU takes minutes cold).
    cfg = get_preset("tiny").replace(max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = tokens(cfg, 2, 64)
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, loss_c = compiled(x[:, :-1], x[:, 1:])
    loss_c.backward()
    assert torch.allclose(loss_c, loss, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, eager[n], rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_compiled_training_backward_takes_only_the_loss_gradient(attention):
    # With targets the logits come back detached, so the compiled forward has one differentiable output: its
    # backward takes the scalar loss gradient, not also a zero-filled [B, T, vocab] one for the logits.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    tangents = []

    def backward_compiler(gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        tangents.extend(tuple(x.shape) for name, x in zip(names, example_inputs) if name.startswith("tangents"))
        return make_boxed_func(gm.forward)

    cfg = small_cfg(attention)
    torch.manual_seed(0)
    model = Transformer(cfg)
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler)
    x = tokens(cfg, 2, 16)
    logits, loss = torch.compile(model, backend=backend, fullgraph=True)(x[:, :-1], x[:, 1:])
    loss.backward()
    assert tangents == [()]
    assert logits.shape == (2, 16, cfg.vocab_size) and not logits.requires_grad


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_forward_backward_never_reads_tensor_values_on_the_host(attention):
    # Meta tensors carry shapes but no data: any .item(), .tolist(), nonzero or unique (a host sync on a
    # GPU) raises here, in the forward or the backward.
    cfg = small_cfg(attention)
    model = Transformer(cfg).to("meta")
    x = torch.zeros(2, 33, dtype=torch.long, device="meta")
    logits, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    model.attention_stats()
    assert logits.shape == (2, 32, cfg.vocab_size) and model.tok_emb.weight.grad.is_meta


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = small_cfg()
    x = tokens(cfg, 2, 24)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg, activation_checkpointing=ckpt)
        model(x[:, :-1], x[:, 1:])[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("T", [5, 23, 64])
def test_flops_key_count_matches_the_reference_selection(T):
    cfg = small_cfg(max_seq_len=64)
    nsa = cfg.nsa
    x = torch.randn(1, T, 2, 4, dtype=torch.float64)
    k_cmp = torch.randn(1, nsa.num_cmp_tokens(T), 1, 4, dtype=torch.float64)
    _, lse = ops.compressed_attention(x, k_cmp, k_cmp, nsa, backend="naive")
    blocks = ops.select_blocks(x, k_cmp, lse, nsa, backend="naive")
    total = 0
    for t in range(T):
        chosen = {j for j in blocks[0, t, 0].tolist() if j >= 0}
        total += nsa.num_cmp_tokens(t + 1) + sum(1 for u in range(t + 1) if u // nsa.sel_block in chosen)
        total += min(nsa.window, t + 1)
    assert _mean_keys_per_query(cfg, T) == pytest.approx(total / T)
    assert _mean_keys_per_query(cfg.replace(attention="dense"), T) == pytest.approx((T + 1) / 2)


def test_flops_per_token_and_params():
    cfg = get_preset("tiny-dense")
    model = Transformer(cfg)
    n = model.num_params()
    assert n == sum(p.numel() for p in model.parameters())
    assert model.num_params(exclude_embeddings=True) == n - cfg.vocab_size * cfg.dim
    attn = 3 * cfg.n_layers * cfg.n_heads * 2 * (cfg.head_dim + cfg.dv) * (256 + 1) / 2
    assert model.flops_per_token(256) == pytest.approx(6 * n + attn)
    tiny = get_preset("tiny")  # at 4096 tokens NSA reads ~Tc + n*l' + w = ~640 keys per query, dense ~2048
    assert _mean_keys_per_query(tiny, 4096) < 0.35 * _mean_keys_per_query(cfg, 4096)


def test_attention_stats_are_device_tensors_in_range():
    cfg = small_cfg()
    model = Transformer(cfg)
    x = tokens(cfg, 2, 32)
    model(x[:, :-1])
    stats = model.attention_stats()
    assert set(stats) == {f"nsa/{s}" for s in NSAAttention.STATS}
    for name in ("nsa/gate_cmp", "nsa/gate_slc", "nsa/gate_win"):
        assert 0.3 < stats[name].item() < 0.7  # sigmoid of a small init
    assert 1 <= stats["nsa/sel_blocks"].item() <= cfg.nsa.n_selected
    assert stats["nsa/sel_distance"].item() > 0
    assert Transformer(small_cfg("dense")).attention_stats() == {}


def test_bad_inputs_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = small_cfg(max_seq_len=16)
    model = Transformer(cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(17, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="backend"):
        Transformer(cfg, backend="cuda")
    with pytest.raises(ValueError, match="triton"):
        Transformer(cfg, backend="triton")(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("l,d,T", [(8, 4, 32), (8, 4, 8), (8, 4, 7), (8, 4, 21), (8, 2, 19), (4, 4, 13),
                                   (16, 8, 64)])
def test_phi_mlp_is_the_spec_formula_on_every_block(l, d, T):
    """Compressor (phi = mlp) against NSA_SPEC's phi written out (unfold, add pos_emb, flatten, Linear, GELU,
    Linear), values and gradients, in float64, for T a multiple of d or not, T = l and T < l."""
    import torch.nn.functional as F

    from nsa_model.attention import Compressor
    from nsa_model.config import NSAConfig

    torch.manual_seed(0)
    nsa = NSAConfig(cmp_block=l, cmp_stride=d, sel_block=16, n_selected=4, window=8)
    phi = Compressor("mlp", 6, nsa, hidden=10).double()
    torch.nn.init.normal_(phi.pos_emb)
    torch.nn.init.normal_(phi.fc1.bias)
    x = torch.randn(2, T, 3, 6, dtype=torch.float64, requires_grad=True)

    def spec(x):
        if T < l:
            return x.new_zeros(2, 0, 3, 6)
        blocks = x.unfold(1, l, d).transpose(-1, -2) + phi.pos_emb  # [B, Tc, G, l, D]
        return phi.fc2(F.gelu(phi.fc1(blocks.flatten(-2))))

    out, ref = phi(x), spec(x)
    assert out.shape == ref.shape == (2, max(0, (T - l) // d + 1), 3, 6)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    if T >= l:
        weights = torch.randn_like(ref)
        grads = torch.autograd.grad((out * weights).sum(), [x, *phi.parameters()])
        ref_grads = torch.autograd.grad((ref * weights).sum(), [x, *phi.parameters()])
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_phi_keeps_no_unfolded_blocks_for_the_backward_and_its_gradients_stand(monkeypatch):
    """phi = mlp recomputes its unfolded blocks in the backward (attention.Compressor): no tensor saved for the
    backward is fc1's input [B, Tc, G, l*D], and every gradient equals the one computed keeping it."""
    from nsa_model import attention

    cfg = small_cfg(phi="mlp")
    torch.manual_seed(0)
    layer = NSAAttention(cfg, backend="torch")
    B, T, l, d = 2, 32, cfg.nsa.cmp_block, cfg.nsa.cmp_stride
    x = torch.randn(B, T, cfg.dim, requires_grad=True)
    Tc = (T - l) // d + 1
    fc1_input = (B * Tc * cfg.n_kv_heads * l * cfg.head_dim, l * cfg.head_dim)  # (numel, width), in any view

    def saved_shapes_and_grads():
        shapes = []

        def pack(t):
            shapes.append((t.numel(), t.shape[-1] if t.dim() else 0))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        return shapes, grads

    shapes, grads = saved_shapes_and_grads()
    assert fc1_input not in shapes
    monkeypatch.setattr(attention, "checkpoint", lambda fn, *args, **kwargs: fn(*args))  # keep everything
    kept_shapes, kept_grads = saved_shapes_and_grads()
    assert fc1_input in kept_shapes  # what the recompute leaves out
    for a, b in zip(grads, kept_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_attention_recompute_gives_the_same_gradients_and_runs_sdpa_once(attention):
    """attention_recompute changes what the backward keeps, never what it computes: loss and gradients are those of
    the model that keeps everything (the torch backend here; the Triton core's own recompute is tested in
    test_triton_kernels.py). Dense keeps SDPA's results: its forward op runs once per layer, not again in the
    backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountSDPA(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            self.calls += name.startswith("aten::_scaled_dot_product") and "backward" not in name
            return func(*args, **(kwargs or {}))

    cfg = small_cfg(attention)
    x = tokens(cfg, 2, 24)
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg, attention_recompute=recompute)
        with CountSDPA() as counter:
            loss = model(x[:, :-1], x[:, 1:])[1]
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, counter.calls))
    (loss, grads, calls), (loss_rc, grads_rc, calls_rc) = results
    assert torch.equal(loss, loss_rc)
    for n in grads:
        assert torch.equal(grads[n], grads_rc[n]), n
    assert calls == calls_rc == (cfg.n_layers if attention == "dense" else 0)


def test_attention_recompute_and_activation_checkpointing_exclude_each_other():
    with pytest.raises(ValueError, match="activation_checkpointing already recomputes the whole block"):
        Transformer(small_cfg(), activation_checkpointing=True, attention_recompute=True)
