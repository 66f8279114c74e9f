"""NSA for one new query over cached keys: the decoding step (NSA_SPEC.md, sections 1-7, at the last position).

    o, blocks = nsa_decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg, scale=None)

    q      [B, H, Dk]        the query at position p = P - 1
    k_slc  [B, P, G, Dk] ... the raw keys and values of positions 0 .. p (the cache, new token included)
    k_cmp  [B, Tc(P), G, Dk] the compressed tokens that exist at p: exactly those query p sees (spec section 1)
    gates  [B, H, 3]
    o      [B, H, Dv];  blocks [B, G, n] int32, ascending, -1 padded

This is the same function as the full core's row p, in the work a decoder needs per token: Tc(P) compressed
scores, n*l' selected keys and w window keys per head, where running the model over its whole context again
costs P times that. It is a fixed set of batched tensor ops (no loop over tokens or blocks, no host sync; P is
the cache's length, a host integer). The selection reuses the vectorized PyTorch path's ordering keys and stable
sort, so ties go to the lower block index as the spec says. Low-precision inputs are computed in float32 and the
output cast back; float64 stays float64.
"""

from __future__ import annotations

import torch

from nsa_model.config import NSAConfig
from nsa_model.ops.torch_impl import _masked_softmax, _selection_keys, _work_dtype, overlap_weights


def _attend(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, G, h, Dv], p [B, G, h, K]) of qg [B, G, h, Dk] over keys/values [B, G, K, D]; visible [B, G, K]."""
    scores = scale * torch.einsum("bghd,bgkd->bghk", qg, keys)
    mask = torch.ones_like(scores, dtype=torch.bool) if visible is None else visible[:, :, None, :].expand_as(scores)
    p, _ = _masked_softmax(scores, mask)
    return torch.einsum("bghk,bgkd->bghd", p, values), p


def select_for_query(p_cmp: torch.Tensor, position: int, cfg: NSAConfig) -> torch.Tensor:
    """blocks [B, G, n] int32 (spec section 4) of the query at `position`, from its compressed probabilities
    p_cmp [B, G, h, Tc] (Tc = 0 when it sees no compressed token: every importance is then 0)."""
    num_blocks = position // cfg.sel_block + 1  # the candidates: every block that starts at or before p
    W = overlap_weights(p_cmp.shape[-1], num_blocks, cfg, p_cmp.device, p_cmp.dtype)
    importance = p_cmp.sum(dim=2) @ W  # over the heads of a group (Eq. 10), then Eq. 9: [B, G, Nb]
    keys = _selection_keys(importance[:, None], position, position + 1, cfg)[:, 0]
    # stable and descending: forced blocks first, importance ties to the lower index (as the full path sorts)
    sorted_keys, order = torch.sort(keys, dim=-1, descending=True, stable=True)
    take = min(cfg.n_selected, num_blocks)
    ids = torch.where(sorted_keys[..., :take] > float("-inf"), order[..., :take], num_blocks)
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids == num_blocks, -1, ids).to(torch.int32)
    return torch.nn.functional.pad(ids, (0, cfg.n_selected - take), value=-1)


def _gather_blocks(x: torch.Tensor, blocks: torch.Tensor, sel_block: int, position: int):
    """(rows [B, G, n*l', D], valid [B, G, n*l']): the positions of each group's chosen blocks read from
    x [B, P, G, D]; padding blocks (-1) and positions after the query are not valid."""
    B, G = blocks.shape[:2]
    pos = (blocks.long()[..., None] * sel_block + torch.arange(sel_block, device=x.device)).flatten(-2)
    valid = (pos >= 0) & (pos <= position)
    b_idx = torch.arange(B, device=x.device)[:, None, None]
    g_idx = torch.arange(G, device=x.device)[None, :, None]
    return x[b_idx, pos.clamp(0, position), g_idx], valid


def check_step_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig) -> None:
    """Refuse inconsistent inputs with a message naming the tensor (shapes are static: no host sync)."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [B, H, Dk] (one query a row), got shape {tuple(q.shape)}")
    B, H, Dk = q.shape
    if k_slc.dim() != 4 or k_slc.shape[1] < 1 or H % k_slc.shape[2]:
        raise ValueError(f"k_slc: expected [B, P >= 1, G, Dk] with G dividing H={H}, got {tuple(k_slc.shape)}")
    P, G, Dv = k_slc.shape[1], k_slc.shape[2], v_slc.shape[-1]
    tc = cfg.num_cmp_tokens(P)
    expected = {"k_slc": (B, P, G, Dk), "v_slc": (B, P, G, Dv), "k_win": (B, P, G, Dk), "v_win": (B, P, G, Dv),
                "k_cmp": (B, tc, G, Dk), "v_cmp": (B, tc, G, Dv), "gates": (B, H, 3)}
    given = {"k_slc": k_slc, "v_slc": v_slc, "k_win": k_win, "v_win": v_win, "k_cmp": k_cmp, "v_cmp": v_cmp,
             "gates": gates}
    for name, want in expected.items():
        if tuple(given[name].shape) != want:
            raise ValueError(f"{name}: expected shape {want} (P = {P} cached positions, Tc(P) = {tc}), "
                             f"got {tuple(given[name].shape)}")


@torch.no_grad()
def nsa_decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig, *,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, Dv], blocks [B, G, n]) of the query at position P - 1 (see the module's docstring)."""
    check_step_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg)
    B, H, Dk = q.shape
    P, G, Dv = k_slc.shape[1], k_slc.shape[2], v_slc.shape[-1]
    position = P - 1
    scale = Dk ** -0.5 if scale is None else float(scale)
    work = _work_dtype(q.dtype)
    qg = q.reshape(B, G, H // G, Dk).to(work)

    def by_group(x):  # [B, K, G, D] -> [B, G, K, D] in the work dtype
        return x.to(work).transpose(1, 2)

    if k_cmp.shape[1] > 0:
        o_cmp, p_cmp = _attend(qg, by_group(k_cmp), by_group(v_cmp), None, scale)
    else:  # nothing compressed is visible yet: the branch gives 0 and every importance is 0
        o_cmp = qg.new_zeros(B, G, H // G, Dv)
        p_cmp = qg.new_zeros(B, G, H // G, 0)
    blocks = select_for_query(p_cmp, position, cfg)

    k_sel, valid = _gather_blocks(k_slc, blocks, cfg.sel_block, position)
    v_sel, _ = _gather_blocks(v_slc, blocks, cfg.sel_block, position)
    o_slc, _ = _attend(qg, k_sel.to(work), v_sel.to(work), valid, scale)

    first = max(0, P - cfg.window)  # the window: positions max(0, p - w + 1) .. p
    o_win, _ = _attend(qg, by_group(k_win[:, first:]), by_group(v_win[:, first:]), None, scale)

    g = gates.to(work).reshape(B, G, H // G, 3, 1)
    o = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return o.reshape(B, H, Dv).to(v_slc.dtype), blocks
