"""bench/saved_activations.py: the tensors the compiled forward saves for the backward, traced without running."""

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parent.parent / "bench" / "saved_activations.py"
_spec = importlib.util.spec_from_file_location("saved_activations", _path)
saved_activations = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = saved_activations  # its dataclass looks its module up
sys.path.insert(0, str(_path.parent.parent))
_spec.loader.exec_module(saved_activations)


def test_one_nsa_layer_saves_its_branch_outputs_and_each_kv_set_once(monkeypatch):
    """The tiny preset at B=2, T=64: what one NSA layer keeps beyond a dense one includes the core's three branch
    outputs [B, T, H, Dv] (bf16 under autocast; q, from nsa::rope_split, has the same site), and the six K/V
    sets [B, T, G, D], each a tensor of its own out of nsa::rope_split, kept once although the core and phi
    both read some of them (storages are counted once, not once per use)."""
    from nsa_model import get_preset

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton core takes CPU tensors (traced only: nothing runs)
    cfg = get_preset("tiny")
    B, T, H, G, D = 2, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    nsa = saved_activations.per_layer("tiny", T, B)
    dense = saved_activations.per_layer("tiny-dense", T, B)
    branch_outputs = nsa["layer_sites"][f"<built-in function getitem> ({B}, {T}, {H}, {D}) bfloat16"]
    kv_sets = nsa["layer_sites"][f"<built-in function getitem> ({B}, {T}, {G}, {D}) bfloat16"]
    assert branch_outputs == (3 + 1) * B * T * H * D * 2
    assert kv_sets == 2 * 3 * B * T * G * D * 2
    assert nsa["layer_bytes"] - dense["layer_bytes"] >= branch_outputs + kv_sets - 2 * B * T * G * D * 2
    assert nsa["rest_bytes"] == dense["rest_bytes"] > B * T * cfg.vocab_size * 2  # the head: bf16 logits and more


def test_with_attention_recompute_an_nsa_layer_keeps_no_kv_set_and_one_branch_output_and_less_than_dense(
        monkeypatch):
    """attention_recompute: the compiled NSA forward keeps no q or K/V set out of nsa::rope_split and of the
    core's branch outputs only the selected one; at the tiny preset a layer then keeps less than a dense layer
    (at nsa-125m T = 32768: kernels-notes.md v27)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from nsa_model import get_preset

    cfg = get_preset("tiny")
    B, T, H, G, D = 2, 64, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kept = saved_activations.per_layer("tiny", T, B)
    recomputed = saved_activations.per_layer("tiny", T, B, recompute=True)
    dense = saved_activations.per_layer("tiny-dense", T, B)
    branch_output, kv_set = (f"<built-in function getitem> ({B}, {T}, {h}, {D}) bfloat16" for h in (H, G))
    assert recomputed["layer_sites"].get(branch_output) == B * T * H * D * 2  # o_slc only
    assert kv_set in kept["layer_sites"] and kv_set not in recomputed["layer_sites"]
    assert recomputed["layer_bytes"] < dense["layer_bytes"] < kept["layer_bytes"]
