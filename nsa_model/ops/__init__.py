"""The NSA functional core (NSA_SPEC.md) and its pieces, behind one backend switch.

Backends compute the same function:
  naive  - ops/reference.py: per-query float64-capable reference, the judge of every other path.
  torch  - ops/torch_impl.py: vectorized PyTorch, a fixed set of batched ops, no host sync.
  triton - ops/triton_impl.py: our Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).
  auto   - triton for CUDA tensors, torch otherwise.

Every backend module exposes the same pieces, with the same meaning:
  compressed_attention(q, k_cmp, v_cmp, cfg, scale) -> (o [B,T,H,Dv], lse [B,T,H] float32, -inf where Nc(t)=0)
  select_blocks(q, k_cmp, lse, cfg, scale)          -> blocks [B,T,G,n] int32, -1 where fewer than n exist
  selected_attention(q, k, v, blocks, cfg, scale)   -> o [B,T,H,Dv]
  window_attention(q, k, v, window, scale)          -> o [B,T,H,Dv]
  nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg, scale, return_blocks[, recompute])
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from nsa_model.config import NSAConfig

BACKENDS = ("naive", "torch", "triton")
_MODULES = {"naive": "nsa_model.ops.reference", "torch": "nsa_model.ops.torch_impl",
            "triton": "nsa_model.ops.triton_impl"}


def _triton_interpreting() -> bool:
    # Triton's own switch: kernels run on CPU tensors in its interpreter (CI).
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The backend that will run for tensor x; a requested backend that cannot run is an error."""
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose one of {('auto',) + BACKENDS}")
    if backend == "triton" and not x.is_cuda and not _triton_interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
                         f"got a tensor on {x.device}")
    return backend


# The CPU backends are loaded up front, so that picking one inside a torch.compile'd forward is a dict lookup
# (dynamo cannot trace importlib); triton is loaded on first use (it may be absent).
_LOADED: dict[str, ModuleType] = {name: importlib.import_module(_MODULES[name]) for name in ("naive", "torch")}


def backend_module(backend: str, x: torch.Tensor) -> ModuleType:
    name = resolve_backend(backend, x)
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(_MODULES[name])
    return _LOADED[name]


def preload(backend: str) -> None:
    """Import the backend modules `backend` may pick, now rather than inside a torch.compile'd forward (dynamo
    cannot trace importlib): triton on a CUDA host (asked for, or "auto") or under Triton's interpreter. Elsewhere
    nothing is imported: a triton forward on CPU tensors then fails with resolve_backend's message."""
    cuda = torch.cuda.is_available()
    if (backend == "auto" and cuda) or (backend == "triton" and (cuda or _triton_interpreting())):
        if "triton" not in _LOADED:
            _LOADED["triton"] = importlib.import_module(_MODULES["triton"])


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig, *,
                  scale: float | None = None, backend: str = "auto", return_blocks: bool = False,
                  recompute: bool = False):
    """NSA of NSA_SPEC.md: o [B,T,H,Dv], or (o, blocks [B,T,G,n]) with return_blocks=True.

    recompute trades time for memory, never results: the triton backend then keeps two [B,T,H,Dv] branch outputs
    less for the backward, which computes them again. The naive and torch backends are differentiated by autograd,
    which keeps what their ops save: for them it changes nothing."""
    check_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg)
    name = resolve_backend(backend, q)
    extra = {"recompute": recompute} if name == "triton" else {}
    return backend_module(name, q).nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg,
                                                 scale=_default_scale(q, scale), return_blocks=return_blocks, **extra)


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, *, scale=None, backend="auto"):
    return backend_module(backend, q).compressed_attention(q, k_cmp, v_cmp, cfg, _default_scale(q, scale))


def select_blocks(q, k_cmp, lse, cfg: NSAConfig, *, scale=None, backend="auto"):
    return backend_module(backend, q).select_blocks(q, k_cmp, lse, cfg, _default_scale(q, scale))


def selected_attention(q, k, v, blocks, cfg: NSAConfig, *, scale=None, backend="auto"):
    return backend_module(backend, q).selected_attention(q, k, v, blocks, cfg, _default_scale(q, scale))


def window_attention(q, k, v, window: int, *, scale=None, backend="auto"):
    return backend_module(backend, q).window_attention(q, k, v, window, _default_scale(q, scale))


def check_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig) -> None:
    """Refuse inconsistent inputs with a message naming the tensor (shapes are static: no host sync)."""
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, Dk], got shape {tuple(q.shape)}")
    B, T, H, Dk = q.shape
    G = k_slc.shape[2] if k_slc.dim() == 4 else -1
    Dv = v_slc.shape[-1] if v_slc.dim() == 4 else -1
    if G <= 0 or H % G != 0:
        raise ValueError(f"k_slc: expected [B, T, G, Dk] with G dividing H={H}, got {tuple(k_slc.shape)}")
    tc = cfg.num_cmp_tokens(T)
    expected = {"k_slc": (B, T, G, Dk), "v_slc": (B, T, G, Dv), "k_win": (B, T, G, Dk), "v_win": (B, T, G, Dv),
                "k_cmp": (B, tc, G, Dk), "v_cmp": (B, tc, G, Dv), "gates": (B, T, H, 3)}
    given = {"k_slc": k_slc, "v_slc": v_slc, "k_win": k_win, "v_win": v_win, "k_cmp": k_cmp, "v_cmp": v_cmp,
             "gates": gates}
    for name, want in expected.items():
        if tuple(given[name].shape) != want:
            raise ValueError(f"{name}: expected shape {want} (Tc({T}) = {tc}), got {tuple(given[name].shape)}")
