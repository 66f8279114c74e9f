"""Tokenizers: BPE training round trip, the byte tokenizer, EOS placement, and clear load errors."""

import pytest

from pipeline.data.config import DataConfig
from pipeline.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from test_data_fixtures import fineweb_rows

TEXTS = [r["text"] for r in fineweb_rows("tok", 300, seed=5)] + ["Ünïcödé — ok ✓ 日本語"]


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return train_bpe(iter(TEXTS), 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_bpe_training_round_trip(bpe_path):
    tok = load_tokenizer(DataConfig(tokenizer=str(bpe_path)))
    assert tok.vocab_size == 400 and tok.eos_id == 0  # <|endoftext|> is the first special token
    ids = tok.encode_batch(TEXTS)
    assert [tok.decode(x) for x in ids] == TEXTS  # byte-level: every string survives
    assert max(len(x) for x in ids) < max(len(t.encode()) for t in TEXTS)  # merges were learned
    assert all(tok.eos_id not in x for x in ids)  # no special tokens added to documents
    again = load_tokenizer(DataConfig(tokenizer=str(bpe_path)))
    assert again.sha256 == tok.sha256 and len(tok.sha256) == 64


def test_byte_tokenizer_decodes_its_ids_and_eos_as_a_line_break():
    tok = ByteTokenizer()
    ids = tok.encode_batch(TEXTS[-1:])[0]
    assert tok.decode(ids) == TEXTS[-1]
    assert tok.decode([104, 105, tok.eos_id, 33]) == "hi\n!"
    assert tok.decode(ids[:1]) == "\N{REPLACEMENT CHARACTER}"  # "Ü" cut after its first byte


def test_training_is_deterministic(bpe_path, tmp_path):
    other = train_bpe(iter(TEXTS), 400, tmp_path / "tokenizer.json")
    assert other.read_text() == bpe_path.read_text()


def test_encode_docs_puts_one_eos_after_each_document(bpe_path):
    tok = load_tokenizer(DataConfig(tokenizer=str(bpe_path)))
    stream, lengths = tok.encode_docs(TEXTS[:5] + [""])
    ids = tok.encode_batch(TEXTS[:5] + [""])
    expected = [t for x in ids for t in x + [tok.eos_id]]
    assert stream.tolist() == expected and lengths.tolist() == [len(x) for x in ids]


def test_byte_tokenizer():
    tok = load_tokenizer(DataConfig(tokenizer="bytes"))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eos_id == 256
    stream, lengths = tok.encode_docs(["hé", "", "x"])
    assert stream.tolist() == [104, 0xC3, 0xA9, 256, 256, 120, 256] and lengths.tolist() == [3, 0, 1]
    assert tok.encode_batch(["hé"]) == [[104, 0xC3, 0xA9]]


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")))


def test_hf_name_not_available_offline_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot load 'no-such-org/no-such-tokenizer' offline"):
        load_tokenizer(DataConfig(tokenizer="no-such-org/no-such-tokenizer"))


def test_tiktoken_unavailable_is_a_clear_error():
    # An encoding no plugin defines: nothing is fetched (a real name such as cl100k_base would go to the network).
    with pytest.raises(ValueError, match="DataConfig.tokenizer: tiktoken encoding 'nsa_no_such_encoding' is not"):
        load_tokenizer(DataConfig(tokenizer="tiktoken:nsa_no_such_encoding"))


def test_eos_token_must_exist(bpe_path):
    with pytest.raises(ValueError, match="DataConfig.eos_token"):
        load_tokenizer(DataConfig(tokenizer=str(bpe_path), eos_token="<|nope|>"))


def test_hf_tokenizer_folder_loads_through_autotokenizer(bpe_path, tmp_path):
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_file=str(bpe_path), eos_token="<|endoftext|>").save_pretrained(tmp_path)
    tok = load_tokenizer(DataConfig(tokenizer=str(tmp_path)))
    assert tok.eos_id == 0 and tok.vocab_size == 400
    assert tok.encode_batch(TEXTS[:3]) == load_tokenizer(DataConfig(tokenizer=str(bpe_path))).encode_batch(TEXTS[:3])


def test_tokenizer_training_stage_of_the_prepare_job(tmp_path):
    import importlib.util
    from pathlib import Path

    from test_data_fixtures import write_corpus

    job_file = Path(__file__).resolve().parent.parent / "jobs" / "prepare_data.py"
    spec = importlib.util.spec_from_file_location("prepare_data_job", job_file)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    src = write_corpus(tmp_path / "src", files=2, docs_per_file=40)
    out = job.main(["--train-tokenizer", str(tmp_path / "bpe.json"), "--set", f"data.source={src}",
                    "--set", "data.vocab_size=320", "--set", "data.tokenizer_train_docs=50"])
    tok = load_tokenizer(DataConfig(tokenizer=str(out)))
    assert tok.vocab_size == 320 and tok.eos_id == 0
    text = "the sparse attention model"
    assert tok.decode(tok.encode_batch([text])[0]) == text


TIKTOKEN_PLUGIN = '''
"""A tiktoken encoding whose files are present locally (tiktoken_ext plugin, as tiktoken's own encodings are)."""
import os

from tiktoken.load import load_tiktoken_bpe

def nsa_test_bpe():
    ranks = load_tiktoken_bpe(os.path.join(os.path.dirname(__file__), "nsa_test_bpe.tiktoken"))
    return {"name": "nsa_test_bpe", "mergeable_ranks": ranks, "special_tokens": {"<|endoftext|>": len(ranks)},
            "pat_str": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"""}

ENCODING_CONSTRUCTORS = {"nsa_test_bpe": nsa_test_bpe}
'''

TIKTOKEN_CHECK = '''
import json, sys
from pipeline.data.config import DataConfig
from pipeline.data.tokenizer import TiktokenTokenizer, load_tokenizer
texts = json.loads(sys.argv[1])
tok = load_tokenizer(DataConfig(tokenizer="tiktoken:nsa_test_bpe"))
assert isinstance(tok, TiktokenTokenizer)
ids = tok.encode_batch(texts)
stream, lengths = tok.encode_docs(texts)
try:
    load_tokenizer(DataConfig(tokenizer="tiktoken:nsa_test_bpe", eos_token="<|nope|>"))
    eos_error = None
except ValueError as e:
    eos_error = str(e)
print(json.dumps({"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256,
                  "ids": ids, "decoded": [tok._enc.decode(x) for x in ids], "stream": stream.tolist(),
                  "lengths": lengths.tolist(), "eos_error": eos_error}))
'''


def test_tiktoken_encoding_with_its_files_present(tmp_path):
    """tiktoken:<encoding> through tiktoken.get_encoding, with the encoding's BPE file on local disk (a plugin in
    tiktoken_ext, the way tiktoken registers its own encodings; no network). Run in a fresh process so that
    tiktoken's registry finds the plugin."""
    import base64
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"at", b"ion", b"io", b"on", b"en", b"an"]
    tokens = [bytes([b]) for b in range(256)] + merges
    plugin = tmp_path / "tiktoken_ext"
    plugin.mkdir()
    (plugin / "nsa_test_bpe.tiktoken").write_text(
        "".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    (plugin / "nsa_test_plugin.py").write_text(TIKTOKEN_PLUGIN)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(repo), os.environ.get("PYTHONPATH")]))}
    texts = ["the thing at the station", "", "Ünïcödé ✓ then"]
    proc = subprocess.run([sys.executable, "-c", TIKTOKEN_CHECK, json.dumps(texts)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["name"] == "tiktoken:nsa_test_bpe" and out["vocab_size"] == len(tokens) + 1
    assert out["eos_id"] == len(tokens) and len(out["sha256"]) == 64
    assert out["decoded"] == texts  # byte-level: every string survives
    assert len(out["ids"][0]) < len(texts[0].encode())  # the merges were used
    assert all(out["eos_id"] not in x for x in out["ids"])  # no special token inside documents
    assert out["stream"] == [t for x in out["ids"] for t in x + [out["eos_id"]]]
    assert out["lengths"] == [len(x) for x in out["ids"]]
    assert "DataConfig.eos_token" in out["eos_error"] and "<|nope|>" in out["eos_error"]
