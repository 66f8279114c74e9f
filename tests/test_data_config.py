import pytest

from pipeline.data.config import DataConfig


def test_defaults_are_the_embedded_setup():
    cfg = DataConfig()
    assert cfg.source == "embedded" and cfg.tokenizer == "embedded" and cfg.block_len == cfg.seq_len + 1


def test_built_from_a_yaml_dict():
    cfg = DataConfig(**{"source": "hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT", "seq_len": 2048,
                        "min_int_score": 3, "tokenizer": "tiktoken:gpt2", "packed_dir": None})
    assert cfg.seq_len == 2048 and cfg.min_int_score == 3


@pytest.mark.parametrize("field, value", [
    ("seq_len", 0), ("seq_len", 1.5), ("seq_len", True), ("val_fraction", 1.0), ("val_fraction", -0.1),
    ("min_int_score", 6), ("min_language_score", 1.5), ("max_doc_chars", 0), ("shuffle_seed", -1),
    ("source", ""), ("source", "ftpx://host/x"), ("tokenizer", "tiktoken:"), ("packed_dir", ""),
    ("max_files", 0), ("vocab_size", 100), ("eos_token", ""), ("embedded_scope", "all"), ("tokenize_tasks", 0),
    ("read_tasks", 0), ("read_tasks", None),
])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"DataConfig.{field}"):
        DataConfig(**{field: value})


def test_unknown_field_is_refused():
    with pytest.raises(TypeError, match="bogus"):
        DataConfig(bogus=1)
