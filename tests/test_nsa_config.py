"""NSAConfig and ModelConfig: every validity rule of NSA_SPEC.md refused at construction naming the field, and the
named presets have the shapes the NSA-core issue asks for."""

from __future__ import annotations

import pytest

from nsa_model import ModelConfig, NSAConfig, Transformer, get_preset
from nsa_model.config import preset_names

VALID = dict(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=16, window=512, n_init_blocks=1, n_local_blocks=2)


def test_paper_defaults_are_valid_and_the_fields_are_the_specs():
    assert NSAConfig() == NSAConfig(**VALID)
    assert set(NSAConfig.__dataclass_fields__) == set(VALID)


@pytest.mark.parametrize("field, value, message", [
    *[(f, 0, f"NSAConfig.{f}: must be positive") for f in VALID],
    *[(f, -3, f"NSAConfig.{f}: must be positive") for f in VALID],
    ("cmp_block", 32.0, "NSAConfig.cmp_block: must be an int"),
    ("window", True, "NSAConfig.window: must be an int"),
    ("cmp_stride", 12, r"NSAConfig.cmp_stride: must divide cmp_block \(12 does not divide 32\)"),
    ("sel_block", 72, r"NSAConfig.cmp_stride: must divide sel_block \(16 does not divide 72\)"),
    ("cmp_block", 96, r"NSAConfig.cmp_block: must be <= sel_block \(96 > 64\)"),
    ("n_selected", 2, r"NSAConfig.n_selected: must be >= n_init_blocks \+ n_local_blocks \(2 < 1 \+ 2\)"),
])
def test_nsa_config_refuses_each_invalid_value_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        NSAConfig(**{**VALID, field: value})


def test_nsa_config_boundaries_are_accepted():
    NSAConfig(cmp_block=64, cmp_stride=64, sel_block=64, n_selected=3, window=1)  # l = l' = d, n = init + local
    NSAConfig(cmp_block=1, cmp_stride=1, sel_block=1, n_selected=3, window=1)


@pytest.mark.parametrize("field, value, message", [
    ("vocab_size", 0, "ModelConfig.vocab_size"), ("dim", -1, "ModelConfig.dim"),
    ("n_layers", 0, "ModelConfig.n_layers"),
    ("n_heads", 0, "ModelConfig.n_heads"), ("head_dim", 63, "ModelConfig.head_dim: must be even"),
    ("n_kv_heads", 5, "ModelConfig.n_kv_heads: must divide n_heads"), ("v_head_dim", 0, "ModelConfig.v_head_dim"),
    ("ffn_hidden", -2, "ModelConfig.ffn_hidden"), ("attention", "sparse", "ModelConfig.attention"),
    ("phi", "max", "ModelConfig.phi"), ("rope_theta", 0.0, "ModelConfig.rope_theta"),
    ("init_std", 0.0, "ModelConfig.init_std"), ("nsa", {"cmp_stride": 5}, "NSAConfig.cmp_stride"),
])
def test_model_config_refuses_each_invalid_value_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{field: value})


def test_model_config_from_dict_refuses_unknown_fields_and_round_trips():
    with pytest.raises(ValueError, match=r"ModelConfig: unknown field\(s\) \['layers'\]"):
        ModelConfig.from_dict({"layers": 2})
    with pytest.raises(ValueError, match=r"ModelConfig.nsa: unknown field\(s\) \['sel_blocks'\]"):
        ModelConfig.from_dict({"nsa": {"sel_blocks": 64}})
    cfg = get_preset("tiny")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_nsa_125m_preset_is_the_m7c_shape():
    cfg = get_preset("nsa-125m")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (768, 12, 12, 2, 64,
                                                                                                   50304)
    assert cfg.heads_per_group == 6 and cfg.attention == "nsa"
    assert cfg.nsa == NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=16, window=512)


def test_tiny_preset_has_a_few_million_parameters():
    n = Transformer(get_preset("tiny")).num_params()
    assert 1_000_000 <= n <= 10_000_000, n


@pytest.mark.parametrize("name", ["tiny", "nsa-125m"])
def test_every_preset_has_a_dense_twin(name):
    assert f"{name}-dense" in preset_names()
    nsa, dense = get_preset(name), get_preset(f"{name}-dense")
    assert dense.attention == "dense" and dense.replace(attention="nsa") == nsa


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown 'nsa-1b'.*tiny-dense"):
        get_preset("nsa-1b")
