"""NSA for one new query over cached keys: the decoding step (NSA_SPEC.md, sections 1-7, at the query's position).

    o, blocks = nsa_decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position, cfg, scale=None)

    q        [B, H, Dk]          the query, at position p
    k_slc .. [B, L, G, D]        raw key and value buffers: positions 0 .. p hold the sequence (p's own included);
                                 what lies past p is never read into the result (a buffer of L >= p + 1 slots)
    k_cmp    [B, S, G, D]        compressed-token buffers: slots 0 .. Nc(p) - 1 hold the tokens query p sees
                                 (spec section 1), S >= Nc(p); later slots are masked
    gates    [B, H, 3]
    position int, or a 1-element integer tensor on the buffers' device
    o        [B, H, Dv];  blocks [B, G, n] int32, -1 where fewer than n blocks exist

The same function as the full core's row p, in the work a decoder needs per token: S compressed scores, n*l'
selected keys and w window keys a head, where running the model over its whole context again costs p times that.
Every shape depends on the buffers' sizes alone, never on p: p is read from a tensor by masks and gathers, so one
CUDA graph of a model's decoding step serves every position (nsa_model/generate.py). A fixed set of batched ops,
no loop over tokens or blocks, no host sync. Block importance by the banded overlap (block_importance); the
compressed tokens' visibility, the candidates and the top-n (forced blocks first, importance ties to the lower
block) are the vectorized PyTorch path's own functions, given the position as a tensor. On the triton backend
the step runs as kernels/decode.py's four launches instead (LaunchConfig.decode_kernel="triton", the default; 4x
faster a step at nsa-125m, 32k positions, v68). Here,
low-precision inputs are computed in float32 and the output cast back; float64 stays float64. Autocast is off
inside: under bf16 autocast the einsums would round every score to bf16 before the softmax (about 2% of a
probability at a score of 5), where the Triton kernels keep scores and probabilities in fp32; over 12 layers that
put the steps' logits 5% of their range off the full pass's at nsa-125m (v67).
"""

from __future__ import annotations

import torch

from nsa_model import ops
from nsa_model.config import NSAConfig
from nsa_model.ops.torch_impl import _masked_softmax, _work_dtype, block_candidates, cmp_visible, top_blocks


def attend_one(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, G, h, Dv], p [B, G, h, K]) of qg [B, G, h, Dk] over keys/values [B, G, K, D] where visible
    [B or 1, G or 1, K]; a head with nothing visible gives zeros."""
    scores = scale * torch.einsum("bghd,bgkd->bghk", qg, keys)
    p, _ = _masked_softmax(scores, visible[:, :, None, :].expand_as(scores))
    return torch.einsum("bghk,bgkd->bghd", p, values), p


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, L, G, D] at positions [B, G, K] (each in 0 .. L - 1) -> [B, G, K, D]."""
    B, G = positions.shape[:2]
    b_idx = torch.arange(B, device=x.device)[:, None, None]
    g_idx = torch.arange(G, device=x.device)[None, :, None]
    return x[b_idx, positions, g_idx]


def block_importance(p: torch.Tensor, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """[B, G, num_blocks]: sum over compressed tokens i of p[..., i] * W[i, j] (spec section 3), without W. W is
    banded: token i starts at piece i (pieces are d long) and covers l/d <= l'/d pieces, so it overlaps the block it
    starts in and at most the next; the tokens starting in one block are a reshape away (d divides l', validated).
    A [slots, blocks] W would be 67 MB a layer at 128k positions; this is a few small ops, deterministic."""
    B, G, S = p.shape
    per_block, per_token = cfg.sel_block // cfg.cmp_stride, cfg.cmp_block // cfg.cmp_stride
    starts = -(-S // per_block)  # blocks in which some slot's token starts
    p = torch.nn.functional.pad(p, (0, starts * per_block - S)).view(B, G, starts, per_block)
    piece = torch.arange(per_block, device=p.device)  # where in its block a token starts
    own = (p * torch.clamp(per_block - piece, max=per_token).to(p.dtype)).sum(-1)
    spill = (p * torch.clamp(piece + per_token - per_block, min=0).to(p.dtype)).sum(-1)
    importance = torch.nn.functional.pad(own, (0, 1)) + torch.nn.functional.pad(spill, (1, 0))  # [B, G, starts + 1]
    if starts + 1 >= num_blocks:  # blocks past the last one hold only tokens no query at p sees (p = 0 there)
        return importance[..., :num_blocks]
    return torch.nn.functional.pad(importance, (0, num_blocks - starts - 1))


def select_for_query(p_cmp: torch.Tensor, position: torch.Tensor, num_blocks: int, cfg: NSAConfig) -> torch.Tensor:
    """blocks [B, G, n] int32 (spec section 4) of the query at `position` among blocks 0 .. num_blocks - 1, from its
    compressed probabilities p_cmp [B, G, h, S] (zero where a slot is not visible): the full path's candidates and
    top-n (torch_impl.block_candidates, top_blocks) on the banded importance."""
    importance = block_importance(p_cmp.sum(dim=2), num_blocks, cfg)  # over the group's heads (Eq. 10), Eq. 9
    candidate, forced = block_candidates(position.reshape(1), num_blocks, cfg)  # [1, Nb]
    return top_blocks(importance, candidate, forced, cfg.n_selected)


def check_step_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig) -> None:
    """Refuse inconsistent inputs with a message naming the tensor (shapes are static: no host sync)."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [B, H, Dk] (one query a row), got shape {tuple(q.shape)}")
    B, H, Dk = q.shape
    if k_slc.dim() != 4 or H % k_slc.shape[2]:
        raise ValueError(f"k_slc: expected [B, L, G, Dk] with G dividing H={H}, got {tuple(k_slc.shape)}")
    L, G, Dv, S = k_slc.shape[1], k_slc.shape[2], v_slc.shape[-1], k_cmp.shape[1]
    expected = {"k_slc": (B, L, G, Dk), "v_slc": (B, L, G, Dv), "k_win": (B, L, G, Dk), "v_win": (B, L, G, Dv),
                "k_cmp": (B, S, G, Dk), "v_cmp": (B, S, G, Dv), "gates": (B, H, 3)}
    given = {"k_slc": k_slc, "v_slc": v_slc, "k_win": k_win, "v_win": v_win, "k_cmp": k_cmp, "v_cmp": v_cmp,
             "gates": gates}
    for name, want in expected.items():
        if tuple(given[name].shape) != want:
            raise ValueError(f"{name}: expected shape {want} (buffers of L = {L} positions and S = {S} compressed "
                             f"slots), got {tuple(given[name].shape)}")


@torch.no_grad()
def nsa_decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position, cfg: NSAConfig, *,
                    scale: float | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, Dv], blocks [B, G, n]) of the query at `position` (see the module's docstring). On the triton
    backend (CUDA's default) the step runs as kernels/decode.py's launches where its launch config asks for them
    and cfg allows (triton_impl.decode_supports); otherwise, and on the other backends, as the PyTorch ops below."""
    check_step_shapes(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg)
    if ops.resolve_backend(backend, q) == "triton":
        triton_impl = ops.backend_module("triton", q)
        if triton_impl.decode_supports(cfg):
            position = torch.as_tensor(position, device=q.device).reshape(1).to(torch.int64)
            return triton_impl.decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position, cfg,
                                           q.shape[-1] ** -0.5 if scale is None else float(scale))
    with torch.autocast(q.device.type, enabled=False):  # in the work dtype, as the kernels keep scores in fp32
        return _step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position, cfg, scale)


def _step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position, cfg: NSAConfig, scale: float | None):
    B, H, Dk = q.shape
    L, G, Dv = k_slc.shape[1], k_slc.shape[2], v_slc.shape[-1]
    position = torch.as_tensor(position, device=q.device)
    scale = Dk ** -0.5 if scale is None else float(scale)
    work = _work_dtype(q.dtype)
    qg = q.reshape(B, G, H // G, Dk).to(work)

    def by_group(x):  # [B, K, G, D] -> [B, G, K, D] in the work dtype
        return x.to(work).transpose(1, 2)

    if k_cmp.shape[1] > 0:
        visible = cmp_visible(position.reshape(1), k_cmp.shape[1], cfg)  # [1, S]
        o_cmp, p_cmp = attend_one(qg, by_group(k_cmp), by_group(v_cmp), visible[None], scale)
    else:  # buffers without a slot (a sequence shorter than l): nothing compressed, every importance 0
        o_cmp, p_cmp = qg.new_zeros(B, G, H // G, Dv), qg.new_zeros(B, G, H // G, 0)
    blocks = select_for_query(p_cmp, position, -(-L // cfg.sel_block), cfg)

    # the chosen blocks' positions, cut at p; padding blocks (-1) are not visible
    offsets = torch.arange(cfg.sel_block, device=q.device)
    sel_pos = (blocks.long()[..., None] * cfg.sel_block + offsets).flatten(-2)  # [B, G, n * l']
    sel_visible = (sel_pos >= 0) & (sel_pos <= position)
    sel_pos = sel_pos.clamp(0, L - 1)
    o_slc, _ = attend_one(qg, gather_positions(k_slc, sel_pos).to(work), gather_positions(v_slc, sel_pos).to(work),
                          sel_visible, scale)

    # the window: positions p - w + 1 .. p that exist
    span = min(cfg.window, L)
    win_pos = position - span + 1 + torch.arange(span, device=q.device)
    win_visible = (win_pos >= 0)[None, None, :]
    win_pos = win_pos.clamp(min=0)[None, None, :].expand(B, G, span)
    o_win, _ = attend_one(qg, gather_positions(k_win, win_pos).to(work), gather_positions(v_win, win_pos).to(work),
                          win_visible, scale)

    g = gates.to(work).reshape(B, G, H // G, 3, 1)
    o = g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
    return o.reshape(B, H, Dv).to(v_slc.dtype), blocks
