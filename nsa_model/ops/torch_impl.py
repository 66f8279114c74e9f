"""Vectorized PyTorch NSA: the same function as ops/reference.py, as a fixed set of batched tensor ops.

No loop over tokens or blocks and no host sync: the only Python loop is over fixed-size query chunks, whose
count depends on static shapes alone, so the code traces under torch.compile. Chunking bounds memory at
O(chunk * (Tc + n*l' + w)) scores per head at a time; nothing T x T is ever built. The selected branch gathers
each query's n*l' keys, which is D times larger than its scores, so when that is large each of its chunks
is recomputed in the backward (activation checkpointing) instead of being kept.

Low-precision inputs are computed in float32 and the outputs cast back; float64 stays float64.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from nsa_model.config import NSAConfig

QUERY_CHUNK = 128  # queries per chunk; bounds the scores held at once


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunks(T: int, size: int = QUERY_CHUNK) -> list[tuple[int, int]]:
    return [(s, min(s + size, T)) for s in range(0, T, size)]


def _split_queries(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Query chunks along dim 1. split's backward is one concatenation; slicing x[:, s:e] per chunk would
    instead build a full-size zero gradient per chunk (quadratic in T)."""
    return x.split(QUERY_CHUNK, dim=1)


def _masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim restricted to `visible`, and its log-sum-exp.

    A row with nothing visible gives probabilities 0 and lse -inf, with finite (zero) gradients: the
    max is replaced by 0 and the denominator by 1 there, so no inf - inf or 0 / 0 is ever formed.
    """
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # the shift cancels; no gradient needed through it
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    expd = torch.exp(scores - row_max)
    denom = expd.sum(dim=-1, keepdim=True)
    has_any = denom > 0
    denom = torch.where(has_any, denom, torch.ones_like(denom))
    lse = torch.where(has_any, row_max + torch.log(denom), torch.full_like(denom, float("-inf")))
    return expd / denom, lse.squeeze(-1)


def _by_group(x: torch.Tensor, G: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, G, h, D] (query heads of group g are g*h .. g*h + h - 1)."""
    B, T, H, D = x.shape
    return x.reshape(B, T, G, H // G, D)


# --- compressed branch -----------------------------------------------------------------------------------------

def cmp_visible(positions: torch.Tensor, num_cmp: int, cfg: NSAConfig) -> torch.Tensor:
    """[..., Tc] for query positions [...] (a device tensor: a decoding step's is never read on the host):
    compressed token i is visible to the query at t iff i*d + l - 1 <= t."""
    i = torch.arange(num_cmp, device=positions.device)
    return i * cfg.cmp_stride + cfg.cmp_block - 1 <= positions[..., None]


def _cmp_scores(q_chunk: torch.Tensor, k_cmp: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, C, G, h, Dk] x [B, Tc, G, Dk] -> [B, C, G, h, Tc]."""
    return scale * torch.einsum("bcghd,bigd->bcghi", q_chunk, k_cmp)


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, scale: float):
    """o_cmp [B,T,H,Dv] and lse [B,T,H] (float32, float64 for float64 inputs; -inf where Nc(t) = 0)."""
    B, T, H, _ = q.shape
    num_cmp, G, Dv = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[-1]
    work = _work_dtype(q.dtype)
    if num_cmp == 0:  # T < l: no query sees anything (a static shape, not a data-dependent branch)
        return v_cmp.new_zeros(B, T, H, Dv), torch.full((B, T, H), float("-inf"), dtype=work, device=q.device)
    qg, k, v = _by_group(q, G).to(work), k_cmp.to(work), v_cmp.to(work)
    outs, lses = [], []
    for (s, e), q_chunk in zip(_chunks(T), _split_queries(qg)):
        visible = cmp_visible(torch.arange(s, e, device=q.device), num_cmp, cfg)[None, :, None, None, :]
        p, lse = _masked_softmax(_cmp_scores(q_chunk, k, scale), visible)
        outs.append(torch.einsum("bcghi,bigd->bcghd", p, v))
        lses.append(lse)
    o = torch.cat(outs, dim=1).reshape(B, T, H, Dv)
    return o.to(v_cmp.dtype), torch.cat(lses, dim=1).reshape(B, T, H)


# --- selection -------------------------------------------------------------------------------------------------

def overlap_weights(num_cmp: int, num_blocks: int, cfg: NSAConfig, device, dtype) -> torch.Tensor:
    """W [Tc, Nb]: |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / d (spec section 3), as interval intersections."""
    start = torch.arange(num_cmp, device=device)[:, None] * cfg.cmp_stride
    block_start = torch.arange(num_blocks, device=device)[None, :] * cfg.sel_block
    lo = torch.maximum(start, block_start)
    hi = torch.minimum(start + cfg.cmp_block, block_start + cfg.sel_block)
    # Every boundary is a multiple of d, so this division is exact.
    return (hi - lo).clamp(min=0).to(dtype) / cfg.cmp_stride


def block_candidates(positions: torch.Tensor, num_blocks: int, cfg: NSAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate, forced) [..., Nb] for query positions [...] (spec section 4): block j is a candidate of the
    query at t iff j*l' <= t, and forced iff also among the first n_init or the n_local blocks ending at t's."""
    t = positions[..., None]
    j = torch.arange(num_blocks, device=positions.device)
    candidate = j * cfg.sel_block <= t
    # j > floor(t / l') - n_local  <=>  (j + n_local) * l' > t   (integer j; no division in the graph)
    local = (j + cfg.n_local_blocks) * cfg.sel_block > t
    return candidate, candidate & ((j < cfg.n_init_blocks) | local)


def top_blocks(importance: torch.Tensor, candidate: torch.Tensor, forced: torch.Tensor, n: int) -> torch.Tensor:
    """blocks [..., n] int32 for importance [..., Nb] and its candidate and forced masks (broadcast to it):
    forced blocks first, then the most important candidates, ties to the lower index; ascending, -1 padded."""
    num_blocks = importance.shape[-1]
    # Python scalars, not host tensors: a CUDA graph of a decoding step refuses a copy from the host
    keys = torch.where(forced, float("inf"), torch.where(candidate, importance, float("-inf")))
    # A stable descending sort puts forced blocks first and breaks importance ties toward the lower index.
    sorted_keys, order = torch.sort(keys, dim=-1, descending=True, stable=True)
    take = min(n, num_blocks)
    ids = torch.where(sorted_keys[..., :take] > float("-inf"), order[..., :take], num_blocks)
    ids = torch.sort(ids, dim=-1).values  # ascending, the padding (num_blocks) last
    ids = torch.where(ids == num_blocks, -1, ids).to(torch.int32)
    return torch.nn.functional.pad(ids, (0, n - take), value=-1)


@torch.no_grad()
def select_blocks(q, k_cmp, lse, cfg: NSAConfig, scale: float):
    """blocks [B,T,G,n] int32: ascending selected block ids, -1 padded; the same for all heads of a group."""
    B, T, H, _ = q.shape
    num_cmp, G = k_cmp.shape[1], k_cmp.shape[2]
    num_blocks, n = cfg.num_sel_blocks(T), cfg.n_selected
    work = torch.promote_types(_work_dtype(q.dtype), lse.dtype)
    qg, k = _by_group(q, G).to(work), k_cmp.to(work)
    W = overlap_weights(num_cmp, num_blocks, cfg, q.device, work)
    lse_g = lse.to(work).reshape(B, T, G, H // G)
    chosen = []
    for s, e in _chunks(T):
        positions = torch.arange(s, e, device=q.device)
        if num_cmp > 0:
            visible = cmp_visible(positions, num_cmp, cfg)[None, :, None, None, :]
            p = torch.exp(_cmp_scores(qg[:, s:e], k, scale) - lse_g[:, s:e, ..., None])
            p = torch.where(visible & torch.isfinite(lse_g[:, s:e, ..., None]), p, torch.zeros_like(p))
            importance = p.sum(dim=3) @ W  # sum over the heads of the group (Eq. 10), then Eq. 9
        else:
            importance = torch.zeros(B, e - s, G, num_blocks, dtype=work, device=q.device)
        candidate, forced = block_candidates(positions, num_blocks, cfg)
        chosen.append(top_blocks(importance, candidate[None, :, None, :], forced[None, :, None, :], n))
    return torch.cat(chosen, dim=1)


# --- selected branch -------------------------------------------------------------------------------------------

def _block_rows(x: torch.Tensor, sel_block: int) -> torch.Tensor:
    """[B, T, G, D] -> [B * G * Nb, l' * D]: one row per (batch, group, selection block), zero-padded at the end."""
    B, T, G, D = x.shape
    num_blocks = -(-T // sel_block)
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, num_blocks * sel_block - T))
    return x.reshape(B, num_blocks, sel_block, G, D).permute(0, 3, 1, 2, 4).reshape(B * G * num_blocks, -1)


def _selected_chunk(q_chunk, k_rows, v_rows, blocks_chunk, start: int, num_blocks: int, sel_block: int,
                    scale: float):
    """Attention of queries [start, start + C) over the keys of their selected blocks.

    Each query's n blocks are gathered as whole rows of l' keys, then masked: padding blocks (-1) and keys
    after the query. The gather is an embedding lookup: on CPU its backward is several times faster than
    index_select's (whose backward became a slow scatter_add for these gradient layouts).
    """
    B, C, G, h, Dk = q_chunk.shape
    n = blocks_chunk.shape[-1]
    blocks = blocks_chunk.long()
    b_idx = torch.arange(B, device=q_chunk.device)[:, None, None, None]
    g_idx = torch.arange(G, device=q_chunk.device)[None, None, :, None]
    rows = ((b_idx * G + g_idx) * num_blocks + blocks.clamp(min=0)).reshape(-1)  # [B*C*G*n]
    k_sel = torch.nn.functional.embedding(rows, k_rows).reshape(B, C, G, n * sel_block, Dk)
    v_sel = torch.nn.functional.embedding(rows, v_rows).reshape(B, C, G, n * sel_block, -1)
    pos = (blocks[..., None] * sel_block + torch.arange(sel_block, device=q_chunk.device)).reshape(B, C, G, -1)
    t = torch.arange(start, start + C, device=q_chunk.device)[None, :, None, None]
    valid = (blocks >= 0).repeat_interleave(sel_block, dim=-1) & (pos <= t)
    scores = scale * torch.einsum("bcghd,bcgkd->bcghk", q_chunk, k_sel)
    p, _ = _masked_softmax(scores, valid[:, :, :, None, :])
    return torch.einsum("bcghk,bcgkd->bcghd", p, v_sel)


# Gathered keys above this many elements per chunk are recomputed in the backward instead of kept
# (a static-shape decision: the same for every call of a given shape).
RECOMPUTE_ABOVE = 1 << 22


def selected_attention(q, k, v, blocks, cfg: NSAConfig, scale: float):
    B, T, H, Dk = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    work = _work_dtype(q.dtype)
    qg = _by_group(q, G).to(work)
    k_rows, v_rows = _block_rows(k.to(work), cfg.sel_block), _block_rows(v.to(work), cfg.sel_block)
    num_blocks = cfg.num_sel_blocks(T)
    gathered = B * min(T, QUERY_CHUNK) * G * blocks.shape[-1] * cfg.sel_block * (Dk + Dv)
    recompute = (gathered > RECOMPUTE_ABOVE and torch.is_grad_enabled()
                 and any(x.requires_grad for x in (q, k, v)))
    outs = []
    for (s, e), q_chunk in zip(_chunks(T), _split_queries(qg)):
        args = (q_chunk, k_rows, v_rows, blocks[:, s:e], s, num_blocks, cfg.sel_block, scale)
        outs.append(checkpoint(_selected_chunk, *args, use_reentrant=False) if recompute
                    else _selected_chunk(*args))
    return torch.cat(outs, dim=1).reshape(B, T, H, Dv).to(v.dtype)


# --- window branch ---------------------------------------------------------------------------------------------

def window_attention(q, k, v, window: int, scale: float):
    """Banded attention: query chunk [s, s + C) reads only keys [s - w + 1, s + C).

    Keys are zero-padded in front by w - 1 (and at the back up to whole chunks) and cut into overlapping
    spans of C + w - 1 with one unfold (a view), so every chunk's key gradient lands in one place.
    """
    B, T, H, _ = q.shape
    G, Dv = k.shape[2], v.shape[-1]
    work = _work_dtype(q.dtype)
    chunk = min(QUERY_CHUNK, T)
    padded_T = -(-T // chunk) * chunk
    span = chunk + window - 1

    def spans(x):  # [B, T, G, D] -> [n_chunks] x [B, G, D, span]
        x = torch.nn.functional.pad(x.to(work), (0, 0, 0, 0, window - 1, padded_T - T))
        return x.unfold(1, span, chunk).unbind(1)

    qg = _by_group(torch.nn.functional.pad(q.to(work), (0, 0, 0, 0, 0, padded_T - T)), G)
    c = torch.arange(chunk, device=q.device)[:, None]  # query offset in its chunk
    r = torch.arange(span, device=q.device)[None, :]  # key offset in its span: key = s - (w - 1) + r
    in_band = (r <= c + window - 1) & (r >= c)  # key <= query and key > query - w
    outs = []
    for (s, _), q_chunk, k_span, v_span in zip(_chunks(padded_T, chunk), qg.split(chunk, dim=1), spans(k), spans(v)):
        visible = in_band & (r >= window - 1 - s)  # and key >= 0 (front padding)
        scores = scale * torch.einsum("bcghd,bgdr->bcghr", q_chunk, k_span)
        p, _ = _masked_softmax(scores, visible[None, :, None, None, :])
        outs.append(torch.einsum("bcghr,bgdr->bcghd", p, v_span))
    return torch.cat(outs, dim=1)[:, :T].reshape(B, T, H, Dv).to(v.dtype)


# --- the whole thing -------------------------------------------------------------------------------------------

def nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig, *, scale: float,
                  return_blocks: bool = False):
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg, scale)
    blocks = select_blocks(q.detach(), k_cmp.detach(), lse.detach(), cfg, scale)
    o_slc = selected_attention(q, k_slc, v_slc, blocks, cfg, scale)
    o_win = window_attention(q, k_win, v_win, cfg.window, scale)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    return (o, blocks) if return_blocks else o
