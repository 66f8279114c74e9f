"""Decoding with a cache: the one-query NSA step (nsa_model/ops/decode.py) against the float64 reference at every
position, Transformer.forward_cached against the model's full forward, RoPE at an offset, and the cache's
refusals. generate() with and without the cache is compared in tests/test_sample.py."""

from __future__ import annotations

import pytest
import torch

from nsa_model.cache import ModelCache
from nsa_model.config import NSAConfig, get_preset
from nsa_model.model import Transformer
from nsa_model.ops import reference
from nsa_model.ops.decode import nsa_decode_step
from nsa_model.rope import RotaryEmbedding

CFG = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=6)


def core_inputs(B, T, H, G, Dk, Dv, cfg, seed=0, dtype=torch.float64, zero_cmp=False):
    torch.manual_seed(seed)
    q = torch.randn(B, T, H, Dk, dtype=dtype)
    kv = [torch.randn(B, T, G, d, dtype=dtype) for d in (Dk, Dv, Dk, Dv)]
    tc = cfg.num_cmp_tokens(T)
    k_cmp = torch.zeros(B, tc, G, Dk, dtype=dtype) if zero_cmp else torch.randn(B, tc, G, Dk, dtype=dtype)
    v_cmp = torch.randn(B, tc, G, Dv, dtype=dtype)
    gates = torch.rand(B, T, H, 3, dtype=dtype)
    return q, *kv, k_cmp, v_cmp, gates


def steps_against_reference(inputs, cfg, position_as_tensor=True):
    """(largest |o step - o reference| over every position, positions whose blocks differ). Each step gets the
    whole sequence's buffers: what lies past its position must not reach its result."""
    q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates = inputs
    o_ref, blocks_ref = reference.nsa_attention(*inputs, cfg, scale=q.shape[-1] ** -0.5, return_blocks=True)
    worst, differ = 0.0, []
    for t in range(q.shape[1]):
        position = torch.tensor([t]) if position_as_tensor else t
        o, blocks = nsa_decode_step(q[:, t], k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates[:, t], position, cfg)
        worst = max(worst, (o - o_ref[:, t]).abs().max().item())
        if not torch.equal(blocks, blocks_ref[:, t]):
            differ.append(t)
    return worst, differ


@pytest.mark.parametrize("B,T,H,G,Dk,Dv,cfg", [
    (2, 37, 6, 1, 8, 6, CFG),  # 6 heads a group, Dk != Dv, T not a multiple of any block size
    (1, 5, 4, 2, 8, 8, CFG),  # T < l: no compressed token, every block a candidate
    (1, 70, 4, 2, 8, 8, NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=3, window=20,
                                  n_init_blocks=1, n_local_blocks=1)),
    (2, 41, 2, 2, 4, 4, NSAConfig(cmp_block=4, cmp_stride=4, sel_block=4, n_selected=5, window=64)),
])
def test_the_decoding_step_is_the_reference_at_every_position(B, T, H, G, Dk, Dv, cfg):
    worst, differ = steps_against_reference(core_inputs(B, T, H, G, Dk, Dv, cfg), cfg)
    assert worst <= 1e-12
    assert differ == []


def test_the_decoding_step_breaks_importance_ties_toward_the_lower_block():
    """Compressed keys all zero: every visible token is equally likely, so blocks covered alike tie, and two of
    the five slots are free for them."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=5, window=6)
    inputs = core_inputs(1, 60, 2, 1, 8, 8, cfg, zero_cmp=True)
    worst, differ = steps_against_reference(inputs, cfg)
    assert worst <= 1e-12 and differ == []


def test_the_decoding_step_in_float32_is_within_the_spec_tolerance():
    inputs = core_inputs(2, 40, 4, 2, 8, 8, CFG, dtype=torch.float32)
    o_ref = reference.nsa_attention(*(x.double() for x in inputs), CFG, scale=8 ** -0.5)
    o, _ = nsa_decode_step(inputs[0][:, 33], *inputs[1:7], inputs[7][:, 33], 33, CFG)
    assert o.dtype == torch.float32
    assert (o.double() - o_ref[:, 33]).abs().max() <= 2e-5 * o_ref[:, 33].abs().max()


def test_the_decoding_step_takes_buffers_longer_than_the_sequence():
    """Buffers of 64 positions and 20 compressed slots holding a sequence of 37: the rest is never read."""
    inputs = core_inputs(2, 37, 4, 2, 8, 8, CFG)
    longer = core_inputs(2, 64, 4, 2, 8, 8, CFG, seed=9)
    for x, y in zip(inputs[1:7], longer[1:7]):
        y[:, :x.shape[1]] = x
    o_ref = reference.nsa_attention(*inputs, CFG, scale=8 ** -0.5)
    for t in (0, 7, 36):
        o, _ = nsa_decode_step(inputs[0][:, t], *longer[1:7], inputs[7][:, t], torch.tensor([t]), CFG)
        assert (o - o_ref[:, t]).abs().max() <= 1e-12


def test_the_decoding_step_refuses_inputs_that_do_not_fit_and_names_them():
    q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates = core_inputs(1, 20, 2, 1, 8, 8, CFG)
    with pytest.raises(ValueError, match=r"v_cmp: expected shape \(1, 4, 1, 8\) \(buffers of L = 20 positions"):
        nsa_decode_step(q[:, -1], k_slc, v_slc, k_win, v_win, k_cmp, v_cmp[:, :3], gates[:, -1], 19, CFG)
    with pytest.raises(ValueError, match=r"q: expected \[B, H, Dk\]"):
        nsa_decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates[:, -1], 19, CFG)


@pytest.mark.parametrize("cfg", [CFG, NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=16, window=512),
                                 NSAConfig(cmp_block=4, cmp_stride=4, sel_block=4, n_selected=5, window=64),
                                 NSAConfig(cmp_block=8, cmp_stride=2, sel_block=16, n_selected=3, window=6)])
@pytest.mark.parametrize("slots,num_blocks", [(1, 1), (9, 3), (40, 7), (40, 30), (129, 33)])
def test_block_importance_is_the_overlap_weights_product(cfg, slots, num_blocks):
    from nsa_model.ops.decode import block_importance
    from nsa_model.ops.torch_impl import overlap_weights

    p = torch.rand(2, 3, slots, dtype=torch.float64)
    W = overlap_weights(slots, num_blocks, cfg, "cpu", torch.float64)
    assert torch.allclose(block_importance(p, num_blocks, cfg), p @ W, rtol=1e-12, atol=1e-12)


def random_model(attention="nsa", seed=0, **changes):
    cfg = get_preset("tiny").replace(attention=attention, max_seq_len=80, **changes)
    torch.manual_seed(seed)
    model = Transformer(cfg).double().eval()
    with torch.no_grad():  # as initialized, the model barely looks at other positions
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("attention,changes", [
    ("nsa", {}),  # phi = mlp, one K/V set per branch, fused projections
    ("nsa", {"shared_kv": True, "phi": "avg", "fused_qkv": False}),
    ("nsa", {"n_kv_heads": 1, "v_head_dim": 32}),
    ("dense", {}),
])
def test_forward_cached_gives_the_full_forward_s_logits(attention, changes):
    """A prompt of 5 tokens (under one compressed block of 16), then one token a call past max_seq_len's 80: the
    steps cross compressed-token ends, selection blocks and the window's start."""
    model = random_model(attention, **changes)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    full, _ = model(tokens)
    cache = model.new_cache()
    steps = [model.forward_cached(tokens[:, :5], cache)]
    steps += [model.forward_cached(tokens[:, t:t + 1], cache) for t in range(5, 80)]
    assert cache.length == 80
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-10 * full.abs().max()


def test_forward_cached_prefills_a_whole_prompt_and_each_step_is_the_next_position():
    model = random_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2))
    full, _ = model(tokens)
    cache = model.new_cache()
    prompt = model.forward_cached(tokens[:, :64], cache)
    step = model.forward_cached(tokens[:, 64:65], cache)
    assert (prompt - full[:, :64]).abs().max() <= 1e-10 * full.abs().max()
    assert (step - full[:, 64:65]).abs().max() <= 1e-10 * full.abs().max()
    # a step that saw the wrong position (its token at 63 again) gives other logits: the test can tell
    other = model.new_cache()
    model.forward_cached(tokens[:, :63], other)
    assert (model.forward_cached(tokens[:, 64:65], other) - full[:, 64:65]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_decoding_steps_use_the_fused_weight_their_prompt_kept(attention, monkeypatch):
    """The prompt makes each layer's fused projection weight once (LayerCache.keep_weights) and uses it; steps
    under the same autocast state reuse it, a step under another makes its own. Under autocast the kept weight
    takes autocast's dtype where autocast would cast it, not a float64 one. All give the full forward's
    logits."""
    from nsa_model import attention as attention_module

    model = random_model(attention)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    full, _ = model(tokens)
    made, fused = [], attention_module.fused_qkv_weight
    monkeypatch.setattr(attention_module, "fused_qkv_weight", lambda *a, **k: made.append(1) or fused(*a, **k))
    cache = model.new_cache()
    steps = [model.forward_cached(tokens[:, :20], cache)]
    assert len(made) == model.cfg.n_layers  # one a layer: the prompt's projection uses the one it keeps
    steps += [model.forward_cached(tokens[:, t:t + 1], cache) for t in range(20, 25)]
    assert len(made) == model.cfg.n_layers  # none made again
    assert (torch.cat(steps, dim=1) - full[:, :25]).abs().max() <= 1e-10 * full.abs().max()

    # float32 under bf16 autocast: the kept weight is bf16, reused by the steps, and not offered outside autocast
    model32 = random_model(attention).float()
    full32, _ = model32(tokens)
    cpu, bf16 = torch.device("cpu"), dict(device_type="cpu", dtype=torch.bfloat16)
    bf16_cache = model32.new_cache()
    with torch.autocast(**bf16):
        steps = [model32.forward_cached(tokens[:, :20], bf16_cache)]
        assert all(layer.kept_weights(cpu)["qkv"].dtype == torch.bfloat16 for layer in bf16_cache.layers)
        made.clear()
        steps += [model32.forward_cached(tokens[:, t:t + 1], bf16_cache) for t in range(20, 23)]
        assert made == []
    assert all(layer.kept_weights(cpu) == {} for layer in bf16_cache.layers)
    assert (torch.cat(steps, dim=1) - full32[:, :23]).abs().max() <= 5e-2 * (full32.max() - full32.min())
    # float64 under autocast: autocast leaves float64 alone, and so does the kept weight; a step outside
    # autocast makes its own
    cache64 = model.new_cache()
    with torch.autocast(**bf16):
        steps = [model.forward_cached(tokens[:, :20], cache64), model.forward_cached(tokens[:, 20:21], cache64)]
    made.clear()
    steps.append(model.forward_cached(tokens[:, 21:22], cache64))
    assert len(made) == model.cfg.n_layers
    assert (torch.cat(steps, dim=1) - full[:, :22]).abs().max() <= 1e-10 * full.abs().max()


def test_a_step_makes_its_compressed_slot_once_for_all_layers(monkeypatch):
    """The newest compressed token's span and slot depend on the position alone: made by the first layer of a
    step that ends one and shared (LayerCache.for_step), made anew each such step; the logits stay the full
    forward's."""
    from nsa_model.attention import NSAAttention

    model = random_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    full, _ = model(tokens)
    made, newest = [], NSAAttention._newest_compressed
    monkeypatch.setattr(NSAAttention, "_newest_compressed", lambda *a: made.append(1) or newest(*a))
    cache = model.new_cache()
    steps = [model.forward_cached(tokens[:, :20], cache)]
    steps += [model.forward_cached(tokens[:, t:t + 1], cache) for t in range(20, 40)]
    ending = sum(model.cfg.nsa.ends_cmp_token(t) for t in range(20, 40))
    assert model.cfg.n_layers > 1 and ending >= 2 and len(made) == ending
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-10 * full.abs().max()


@pytest.mark.parametrize("changes", [{}, {"shared_kv": True, "phi": "avg", "fused_qkv": False}])
def test_only_the_steps_that_end_a_compressed_token_run_phi(changes, monkeypatch):
    """phi runs in a step where a compressed token ends (one in d), in every layer, and in no other step, whose
    layers read the compressed buffers as they are; every step's logits are the full forward's."""
    from nsa_model.attention import Compressor

    model = random_model(**changes)
    nsa = model.cfg.nsa
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 60), generator=torch.Generator().manual_seed(5))
    full, _ = model(tokens)
    calls, forward, pair = [], Compressor.forward, Compressor.pair
    monkeypatch.setattr(Compressor, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    monkeypatch.setattr(Compressor, "pair", lambda self, *a, **k: calls.append(2) or pair(self, *a, **k))
    cache = model.new_cache()
    steps = [model.forward_cached(tokens[:, :nsa.cmp_block - 3], cache)]
    for t in range(nsa.cmp_block - 3, 60):
        calls.clear()
        steps.append(model.forward_cached(tokens[:, t:t + 1], cache))
        assert len(calls) == (2 * model.cfg.n_layers if nsa.ends_cmp_token(t) else 0), (t, calls)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-10 * full.abs().max()


def test_a_compressed_token_ends_where_the_count_of_them_grows():
    for cfg in (CFG, NSAConfig(), NSAConfig(cmp_block=4, cmp_stride=4, sel_block=8)):
        for p in range(300):
            assert cfg.ends_cmp_token(p) == (cfg.num_cmp_tokens(p + 1) > cfg.num_cmp_tokens(p)), (cfg, p)


def test_forward_cached_refuses_what_the_cache_cannot_take():
    model = random_model("dense")
    cache = model.new_cache()
    model.forward_cached(torch.zeros(1, 78, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="takes one token a call, got 2"):
        model.forward_cached(torch.zeros(1, 2, dtype=torch.long), cache)
    model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
    model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="80 cached \\+ 1 new positions exceed the cache's 80"):
        model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
    assert cache.length == 80
    with pytest.raises(ValueError, match="at least one token"):
        model.forward_cached(torch.zeros(1, 0, dtype=torch.long), model.new_cache())
    two_rows = model.new_cache()
    model.forward_cached(torch.zeros(2, 5, dtype=torch.long), two_rows)
    with pytest.raises(ValueError, match="the cache holds 2 rows \\(its prompt's batch\\), got a step of 1"):
        model.forward_cached(torch.zeros(1, 1, dtype=torch.long), two_rows)
    with pytest.raises(ValueError, match="decode_step: the cache holds no prompt yet"):
        model.decode_step(torch.zeros(1, 1, dtype=torch.long), model.new_cache(), False)
    with pytest.raises(ValueError, match="capacity: must be >= 1"):
        ModelCache(2, 0, torch.device("cpu"))


def test_rope_at_an_offset_rotates_as_those_positions_of_the_whole_sequence():
    rope = RotaryEmbedding(8, 16, 10000.0)
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    assert torch.equal(rope(x[:, 5:9], position=5), rope(x)[:, 5:9])
    assert torch.equal(rope(x[:, 5:6], position=torch.tensor([5])), rope(x)[:, 5:6])  # a decoding step's
    with pytest.raises(ValueError, match="sequence length 2 from position 15 exceeds max_seq_len 16"):
        rope(x[:, :2], position=15)
    with pytest.raises(ValueError, match="position must be >= 0"):
        rope(x[:, :2], position=-1)
