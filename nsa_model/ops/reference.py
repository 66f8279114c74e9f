"""The naive NSA reference: the judge of every other backend.

Written straight from NSA_SPEC.md, one query and one head at a time, with plain Python loops. It is slow on
purpose: each line should be checkable against the spec by eye. It runs in the dtype it is given (use float64
to judge), and gradients reach every tensor input through autograd; the discrete choice of blocks carries none.

Only this file may loop over tokens and blocks. Every fast path (ops/torch_impl.py, ops/triton_impl.py) is
compared against it.
"""

from __future__ import annotations

import torch

from nsa_model.config import NSAConfig


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is float32 for float32 and narrower inputs, float64 for float64 inputs (so a float64 judge stays exact)."""
    return torch.promote_types(dtype, torch.float32)


def _attend(q_th: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * keys @ q) @ values for one query vector."""
    scores = scale * (keys @ q_th)
    return torch.softmax(scores, dim=0) @ values


def _stack_bthd(rows: list[torch.Tensor], B: int, T: int, H: int) -> torch.Tensor:
    """Rows in (b, t, h) loop order -> tensor [B, T, H, ...]."""
    out = torch.stack(rows)
    return out.reshape(B, T, H, *out.shape[1:])


# --- 1 + 2: compressed branch ----------------------------------------------------------------------------------

def num_visible_cmp(t: int, cfg: NSAConfig) -> int:
    """Nc(t): compressed tokens i with i*d + l - 1 <= t (spec section 1)."""
    return cfg.num_cmp_tokens(t + 1)


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, scale: float):
    """o_cmp [B,T,H,Dv] and lse [B,T,H] (-inf where no compressed token is visible)."""
    B, T, H, _ = q.shape
    G, Dv = k_cmp.shape[2], v_cmp.shape[-1]
    h_per_g = H // G
    outs, lses = [], []
    for b in range(B):
        for t in range(T):
            nc = num_visible_cmp(t, cfg)
            for h in range(H):
                g = h // h_per_g
                if nc == 0:  # nothing visible: the branch contributes exactly zero
                    outs.append(v_cmp.new_zeros(Dv))
                    lses.append(torch.tensor(float("-inf"), dtype=lse_dtype(q.dtype), device=q.device))
                    continue
                scores = scale * (k_cmp[b, :nc, g] @ q[b, t, h])
                outs.append(torch.softmax(scores, dim=0) @ v_cmp[b, :nc, g])
                lses.append(torch.logsumexp(scores, dim=0).to(lse_dtype(q.dtype)))
    return _stack_bthd(outs, B, T, H), _stack_bthd(lses, B, T, H)


# --- 3 + 4: block importance and selection ---------------------------------------------------------------------

def overlap_weights(num_cmp: int, num_blocks: int, cfg: NSAConfig) -> list[list[int]]:
    """W[i][j] of spec section 3, by Eq. 9's double sum: each d-sized piece of compressed token i adds 1
    to the selection block that contains it."""
    W = [[0] * num_blocks for _ in range(num_cmp)]
    for i in range(num_cmp):
        for piece in range(cfg.cmp_block // cfg.cmp_stride):
            start = i * cfg.cmp_stride + piece * cfg.cmp_stride
            j = start // cfg.sel_block
            if j < num_blocks:
                W[i][j] += 1
    return W


def _choose_blocks(t: int, importance: list[float], cfg: NSAConfig) -> list[int]:
    """S(t) of spec section 4, ascending; importance[j] for every candidate j."""
    candidates = list(range(t // cfg.sel_block + 1))  # j * l' <= t
    if len(candidates) <= cfg.n_selected:
        return candidates
    current = t // cfg.sel_block
    forced = set(range(cfg.n_init_blocks)) | set(range(current - cfg.n_local_blocks + 1, current + 1))
    forced = {j for j in forced if j in candidates}
    others = sorted((j for j in candidates if j not in forced), key=lambda j: (-importance[j], j))
    return sorted(forced | set(others[: cfg.n_selected - len(forced)]))


@torch.no_grad()
def select_blocks(q, k_cmp, lse, cfg: NSAConfig, scale: float):
    """blocks [B,T,G,n] int32: ascending selected block ids, -1 padded; identical for the heads of a group."""
    B, T, H, _ = q.shape
    G = k_cmp.shape[2]
    h_per_g = H // G
    num_blocks = cfg.num_sel_blocks(T)
    W = overlap_weights(cfg.num_cmp_tokens(T), num_blocks, cfg)
    blocks = torch.full((B, T, G, cfg.n_selected), -1, dtype=torch.int32, device=q.device)
    for b in range(B):
        for t in range(T):
            nc = num_visible_cmp(t, cfg)
            for g in range(G):
                importance = [0.0] * num_blocks
                for h in range(g * h_per_g, (g + 1) * h_per_g):
                    if nc == 0:
                        continue
                    # p_cmp[t, h, i] from the compressed branch's own lse.
                    p = torch.exp(scale * (k_cmp[b, :nc, g] @ q[b, t, h]).to(lse.dtype) - lse[b, t, h]).tolist()
                    for i in range(nc):
                        for j in range(num_blocks):
                            importance[j] += p[i] * W[i][j]
                chosen = _choose_blocks(t, importance, cfg)
                blocks[b, t, g, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return blocks


# --- 5: selected branch ----------------------------------------------------------------------------------------

def selected_attention(q, k, v, blocks, cfg: NSAConfig, scale: float):
    """Each query attends to the positions u <= t whose block is among its group's selected blocks."""
    B, T, H, _ = q.shape
    G = k.shape[2]
    h_per_g = H // G
    outs = []
    for b in range(B):
        for t in range(T):
            for h in range(H):
                g = h // h_per_g
                chosen = {j for j in blocks[b, t, g].tolist() if j >= 0}
                keys = [u for u in range(t + 1) if u // cfg.sel_block in chosen]
                if not keys:  # cannot happen with valid blocks (the current block is forced); stay finite anyway
                    outs.append(v.new_zeros(v.shape[-1]))
                    continue
                idx = torch.tensor(keys, device=q.device)
                outs.append(_attend(q[b, t, h], k[b, idx, g], v[b, idx, g], scale))
    return _stack_bthd(outs, B, T, H)


# --- 6: window branch ------------------------------------------------------------------------------------------

def window_attention(q, k, v, window: int, scale: float):
    """Each query attends to positions max(0, t - w + 1) .. t."""
    B, T, H, _ = q.shape
    G = k.shape[2]
    h_per_g = H // G
    outs = []
    for b in range(B):
        for t in range(T):
            lo = max(0, t - window + 1)
            for h in range(H):
                g = h // h_per_g
                outs.append(_attend(q[b, t, h], k[b, lo : t + 1, g], v[b, lo : t + 1, g], scale))
    return _stack_bthd(outs, B, T, H)


# --- 7: the whole thing ----------------------------------------------------------------------------------------

def nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig, *, scale: float,
                  return_blocks: bool = False):
    o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg, scale)
    blocks = select_blocks(q.detach(), k_cmp.detach(), lse.detach(), cfg, scale)
    o_slc = selected_attention(q, k_slc, v_slc, blocks, cfg, scale)
    o_win = window_attention(q, k_win, v_win, cfg.window, scale)
    o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    return (o, blocks) if return_blocks else o
