"""Typed configuration for NSA attention and the decoder model.

Every field is validated when the object is built: an impossible value raises
ValueError naming the field, so a bad config never reaches a kernel or a worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

AttentionKind = Literal["nsa", "dense"]
PhiKind = Literal["avg", "mlp"]


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")


@dataclass(frozen=True)
class NSAConfig:
    """The NSA hyperparameters of NSA_SPEC.md (paper symbols in brackets)."""

    cmp_block: int = 32  # l: raw tokens summarized by one compressed token
    cmp_stride: int = 16  # d: stride between compressed tokens
    sel_block: int = 64  # l': selection block size
    n_selected: int = 16  # n: selected blocks per query, forced ones included
    window: int = 512  # w: sliding window length, query included
    n_init_blocks: int = 1  # leading blocks always selected
    n_local_blocks: int = 2  # trailing blocks (the query's own and the one before) always selected

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(isinstance(value, int) and not isinstance(value, bool), f"NSAConfig.{f.name}",
                     f"must be an int, got {value!r}")
            _require(value > 0, f"NSAConfig.{f.name}", f"must be positive, got {value}")
        _require(self.cmp_block % self.cmp_stride == 0, "NSAConfig.cmp_stride",
                 f"must divide cmp_block ({self.cmp_stride} does not divide {self.cmp_block})")
        _require(self.sel_block % self.cmp_stride == 0, "NSAConfig.cmp_stride",
                 f"must divide sel_block ({self.cmp_stride} does not divide {self.sel_block})")
        _require(self.cmp_block <= self.sel_block, "NSAConfig.cmp_block",
                 f"must be <= sel_block ({self.cmp_block} > {self.sel_block})")
        _require(self.n_selected >= self.n_init_blocks + self.n_local_blocks, "NSAConfig.n_selected",
                 f"must be >= n_init_blocks + n_local_blocks "
                 f"({self.n_selected} < {self.n_init_blocks} + {self.n_local_blocks})")

    def num_cmp_tokens(self, seq_len: int) -> int:
        """Tc(T) of NSA_SPEC.md section 1."""
        if seq_len < self.cmp_block:
            return 0
        return (seq_len - self.cmp_block) // self.cmp_stride + 1

    def ends_cmp_token(self, position: int) -> bool:
        """Whether a compressed token ends at raw position `position` (its last raw token, section 1): one
        position in d from l - 1 on."""
        start = position + 1 - self.cmp_block
        return start >= 0 and start % self.cmp_stride == 0

    def num_sel_blocks(self, seq_len: int) -> int:
        """Number of selection blocks that hold at least one of seq_len tokens."""
        return -(-seq_len // self.sel_block)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder whose attention is NSA (or dense, for baselines)."""

    vocab_size: int = 50304
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 2
    head_dim: int = 64  # Dk: query/key head dim
    v_head_dim: int | None = None  # Dv; None means head_dim
    ffn_hidden: int | None = None  # SwiGLU hidden size; None means round_up(8/3 * dim, 64)
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    attention: AttentionKind = "nsa"
    phi: PhiKind = "mlp"  # NSA compression function
    phi_hidden: int | None = None  # hidden width of the mlp phi; None means head_dim * 2
    shared_kv: bool = False  # one K/V projection for all branches (else one per branch, paper 3.3.3)
    fused_qkv: bool = True  # q, k and v from one matmul of the three weights concatenated (parameters unchanged)
    fused_gate: bool = True  # with fused_qkv, NSA's gate weight joins that matmul (width padded to 64)
    tie_embeddings: bool = True
    init_std: float = 0.02
    norm_eps: float = 1e-5
    nsa: NSAConfig = field(default_factory=NSAConfig)

    def __post_init__(self) -> None:
        if isinstance(self.nsa, dict):  # built from YAML
            object.__setattr__(self, "nsa", NSAConfig(**self.nsa))
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"ModelConfig.{name}",
                     f"must be a positive int, got {value!r}")
        for name in ("v_head_dim", "ffn_hidden", "phi_hidden"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, int) and value > 0), f"ModelConfig.{name}",
                     f"must be None or a positive int, got {value!r}")
        _require(self.n_heads % self.n_kv_heads == 0, "ModelConfig.n_kv_heads",
                 f"must divide n_heads ({self.n_kv_heads} does not divide {self.n_heads})")
        _require(self.head_dim % 2 == 0, "ModelConfig.head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.attention in ("nsa", "dense"), "ModelConfig.attention",
                 f"must be 'nsa' or 'dense', got {self.attention!r}")
        _require(self.phi in ("avg", "mlp"), "ModelConfig.phi", f"must be 'avg' or 'mlp', got {self.phi!r}")
        for name in ("shared_kv", "fused_qkv", "fused_gate", "tie_embeddings"):
            _require(isinstance(getattr(self, name), bool), f"ModelConfig.{name}",
                     f"must be a bool, got {getattr(self, name)!r}")
        _require(self.rope_theta > 0, "ModelConfig.rope_theta", f"must be positive, got {self.rope_theta}")
        _require(self.init_std > 0, "ModelConfig.init_std", f"must be positive, got {self.init_std}")
        _require(isinstance(self.nsa, NSAConfig), "ModelConfig.nsa", f"must be an NSAConfig, got {self.nsa!r}")

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return ((8 * self.dim // 3) + 63) // 64 * 64

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _require(not unknown, "ModelConfig", f"unknown field(s) {unknown}")
        d = dict(d)
        if isinstance(d.get("nsa"), dict):
            nsa_known = {f.name for f in dataclasses.fields(NSAConfig)}
            bad = sorted(set(d["nsa"]) - nsa_known)
            _require(not bad, "ModelConfig.nsa", f"unknown field(s) {bad}")
            d["nsa"] = NSAConfig(**d["nsa"])
        return cls(**d)


def _tiny() -> ModelConfig:
    # A few million parameters; NSA blocks scaled down so that selection is
    # really sparse at the tiny model's sequence length (256 tokens -> 16 blocks, 4 selected).
    return ModelConfig(
        vocab_size=4096, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
        max_seq_len=256, phi="mlp",
        nsa=NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, n_selected=4, window=64),
    )


def _nsa_125m() -> ModelConfig:
    # The earlier attempt's "M7C" shape: 12 heads over 2 KV heads (6 heads per group).
    return ModelConfig(
        vocab_size=50304, dim=768, n_layers=12, n_heads=12, n_kv_heads=2, head_dim=64,
        max_seq_len=2048, phi="mlp",
        nsa=NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_selected=16, window=512),
    )


_PRESETS = {"tiny": _tiny, "nsa-125m": _nsa_125m}


def preset_names() -> list[str]:
    names = []
    for name in _PRESETS:
        names += [name, f"{name}-dense"]
    return names


def get_preset(name: str) -> ModelConfig:
    """A named model config; `<name>-dense` is the same model with dense attention."""
    base, dense = (name[: -len("-dense")], True) if name.endswith("-dense") else (name, False)
    if base not in _PRESETS:
        raise ValueError(f"model preset: unknown {name!r}; known: {preset_names()}")
    cfg = _PRESETS[base]()
    return cfg.replace(attention="dense") if dense else cfg
