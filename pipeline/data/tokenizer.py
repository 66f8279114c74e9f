"""Tokenizers behind one small interface, and the BPE training stage.

`load_tokenizer(cfg)` understands: "embedded" (byte-level BPE trained on the embedded corpus, built on
first use), "bytes" (UTF-8 bytes + EOS), "tiktoken:<encoding>" (when tiktoken and its encoding files are
present), a tokenizer.json path, or an HF name/path (transformers.AutoTokenizer, offline only).
Every tokenizer has `.name`, `.vocab_size`, `.eos_id`, `.sha256` (hash of its definition) and
`.encode_batch(texts) -> list[list[int]]`; `.encode_docs(texts)` is the packing fast path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from pipeline.data.config import BYTES, EMBEDDED, TIKTOKEN_PREFIX, DataConfig

DEFAULT_EOS = "<|endoftext|>"
_EOS_CANDIDATES = (DEFAULT_EOS, "</s>", "<eos>", "<|end_of_text|>")
_EMBEDDED_VOCAB = 4096  # the `tiny` preset's vocab_size: its tokenizer lives at the documented path


class Tokenizer:
    """The interface; subclasses implement `encode_batch`."""

    name: str
    vocab_size: int
    eos_id: int
    sha256: str

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (jobs/sample.py); special tokens come out as their text (the byte tokenizer's EOS,
        which has none, as a line break)."""
        raise NotImplementedError

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token stream of `texts` with one EOS after each, and each document's token count (no EOS)."""
        ids = self.encode_batch(texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        for x in ids:  # per document, not per token
            x.append(self.eos_id)
        stream = np.concatenate([np.array(x, dtype=np.int64) for x in ids]) if ids else np.empty(0, np.int64)
        return stream, lengths

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (tokenizer.json, or the fast backend of an AutoTokenizer)."""

    def __init__(self, tok, name: str, eos_token: str | None):
        self._tok = tok
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = _find_eos(tok.token_to_id, eos_token, name)
        self.sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # No special tokens: documents are separated by our own EOS, never by a BOS/EOS post-processor.
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 and EOS = 256; vectorized, no per-token Python."""

    def __init__(self):
        self.name = BYTES
        self.vocab_size = 257
        self.eos_id = 256
        self.sha256 = hashlib.sha256(b"utf-8 bytes + eos 256").hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8", errors="replace")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # EOS as a line break: the byte stream has no text for it; a byte sequence cut mid-character shows as U+FFFD
        return b"".join(b"\n" if i == self.eos_id else bytes([i]) for i in ids).decode("utf-8", errors="replace")

    def encode_docs(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        eos = bytes([0])  # placeholder byte, replaced below by position
        raw = [t.encode("utf-8", errors="replace") for t in texts]
        lengths = np.fromiter((len(b) for b in raw), dtype=np.int64, count=len(raw))
        stream = np.frombuffer(eos.join(raw) + eos, dtype=np.uint8).astype(np.int64) if raw else np.empty(0, np.int64)
        stream[np.cumsum(lengths + 1) - 1] = self.eos_id
        return stream, lengths


class TiktokenTokenizer(Tokenizer):
    def __init__(self, encoding: str, eos_token: str | None):
        try:
            import tiktoken
        except ImportError as e:
            raise ValueError(f"DataConfig.tokenizer: tiktoken:{encoding} needs the tiktoken package "
                             f"(pip install tiktoken) and its encoding files in the local cache") from e
        try:
            self._enc = tiktoken.get_encoding(encoding)
        except Exception as e:  # tiktoken raises several kinds when the files cannot be fetched
            raise ValueError(f"DataConfig.tokenizer: tiktoken encoding {encoding!r} is not available offline "
                             f"(set TIKTOKEN_CACHE_DIR to a folder holding its files): {e}") from e
        self.name = f"{TIKTOKEN_PREFIX}{encoding}"
        self.vocab_size = self._enc.n_vocab
        eos = eos_token or DEFAULT_EOS
        if eos not in self._enc.special_tokens_set:
            raise ValueError(f"DataConfig.eos_token: {eos!r} is not a special token of tiktoken:{encoding}")
        self.eos_id = self._enc.encode_single_token(eos)
        self.sha256 = hashlib.sha256(f"tiktoken:{encoding}:{self._enc._pat_str}:{self.vocab_size}".encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)


def _find_eos(token_to_id, eos_token: str | None, name: str) -> int:
    candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
    for tok in candidates:
        tid = token_to_id(tok)
        if tid is not None:
            return tid
    raise ValueError(f"DataConfig.eos_token: tokenizer {name!r} has none of the EOS tokens {candidates}; "
                     f"set data.eos_token to one of its special tokens")


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer named by cfg.tokenizer (see the module docstring)."""
    spec = cfg.tokenizer
    if spec == EMBEDDED:
        return load_tokenizer_file(ensure_embedded_tokenizer(cfg), cfg.eos_token)
    if spec == BYTES:
        return ByteTokenizer()
    if spec.startswith(TIKTOKEN_PREFIX):
        return TiktokenTokenizer(spec[len(TIKTOKEN_PREFIX):], cfg.eos_token)
    if spec.endswith(".json"):
        if not Path(spec).is_file():
            raise ValueError(f"DataConfig.tokenizer: tokenizer file {spec!r} does not exist")
        return load_tokenizer_file(Path(spec), cfg.eos_token)
    return _load_auto_tokenizer(spec, cfg.eos_token)


def load_tokenizer_file(path: Path, eos_token: str | None = None) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    return HFTokenizer(RawTokenizer.from_file(str(path)), str(path), eos_token)


def _load_auto_tokenizer(spec: str, eos_token: str | None) -> HFTokenizer:
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as e:  # OSError / ValueError depending on what is missing
        raise ValueError(f"DataConfig.tokenizer: cannot load {spec!r} offline: it is neither a local folder nor "
                         f"in the Hugging Face cache (no network here; download it elsewhere or give a "
                         f"tokenizer.json path). Cause: {e}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"DataConfig.tokenizer: {spec!r} has no fast (Rust) tokenizer; give its tokenizer.json")
    eos = eos_token or tok.eos_token
    return HFTokenizer(tok.backend_tokenizer, spec, eos)


# ---- the tokenizer training stage ----------------------------------------------------------------

def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path, eos_token: str = DEFAULT_EOS) -> Path:
    """Train a byte-level BPE of `vocab_size` (EOS included) on `texts`; save tokenizer.json atomically."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json", dir=out_path.parent)
    os.close(fd)
    tok.save(tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_path)  # atomic: concurrent first uses never read a half-written file
    return out_path


def embedded_tokenizer_path(cfg: DataConfig) -> Path:
    """Cached by corpus scope (and, for "installed", the corpus key) and vocab size."""
    root = Path(cfg.output_dir).resolve() / "tokenizer"
    if cfg.embedded_scope != "stdlib":
        from pipeline.data.corpus import corpus_key
        scope = f"{cfg.embedded_scope}-{corpus_key(cfg.embedded_scope)}"
        return root / scope / f"bpe-{cfg.vocab_size}" / "tokenizer.json"
    if cfg.vocab_size == _EMBEDDED_VOCAB:
        return root / "tokenizer.json"
    return root / f"bpe-{cfg.vocab_size}" / "tokenizer.json"


def train_tokenizer(cfg: DataConfig, out_path: Path) -> Path:
    """The tokenizer training stage: the first cfg.tokenizer_train_docs cleaned training documents of
    cfg.source (seeded file order) -> byte-level BPE of cfg.vocab_size -> out_path (tokenizer.json)."""
    from pipeline.data.source import sample_texts
    return train_bpe(sample_texts(cfg, cfg.tokenizer_train_docs), cfg.vocab_size, Path(out_path),
                     cfg.eos_token or DEFAULT_EOS)


def ensure_embedded_tokenizer(cfg: DataConfig) -> Path:
    """The project's BPE (cfg.vocab_size) trained on the embedded corpus, built on first use."""
    path = embedded_tokenizer_path(cfg)
    if not path.exists():
        train_tokenizer(cfg.replace(source=EMBEDDED), path)
    return path


def copy_tokenizer(tokenizer: Tokenizer, folder: Path) -> Path | None:
    """Copy a file-backed tokenizer next to prepared data or a checkpoint (None when not file-backed)."""
    if isinstance(tokenizer, HFTokenizer) and Path(tokenizer.name).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(tokenizer.name, folder / "tokenizer.json"))
    return None
