"""The Triton backend against the naive float64 reference (NSA_SPEC.md invariants).

Without CUDA the kernels run in Triton's interpreter on CPU: triton.jit reads TRITON_INTERPRET when a kernel is
defined, so this module sets it only while it imports the backend and restores the environment at once (other
test modules see what they started with). The interpreter costs about a millisecond per op and program, hence
the small shapes. On a CUDA host the same tests run compiled, on CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from nsa_model.config import ModelConfig, NSAConfig
from nsa_model.ops import reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _import_triton_backend():
    if ON_GPU:
        return importlib.import_module("nsa_model.ops.triton_impl")
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("nsa_model.ops.triton_impl")
        # The interpreter imports gluon at its first launch, and gluon checks the variable on import: do it now.
        importlib.import_module("triton.experimental.gluon")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    if not module.INTERPRETED:
        raise RuntimeError("nsa_model.ops.triton_impl was imported before this module without TRITON_INTERPRET=1; "
                           "its kernels are compiled for CUDA and cannot run on this CPU-only host")
    return module


triton_impl = _import_triton_backend()

NAMES = ("q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates")
FP32_TOL = 2e-5


def make_inputs(B, T, H, G, Dk, Dv, cfg: NSAConfig, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    tc = cfg.num_cmp_tokens(T)
    shapes = {"q": (B, T, H, Dk), "k_slc": (B, T, G, Dk), "v_slc": (B, T, G, Dv), "k_win": (B, T, G, Dk),
              "v_win": (B, T, G, Dv), "k_cmp": (B, tc, G, Dk), "v_cmp": (B, tc, G, Dv)}
    inputs = {name: torch.randn(*shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    inputs["gates"] = torch.rand(B, T, H, 3, generator=gen, dtype=torch.float64)
    return {name: x.to(dtype) for name, x in inputs.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, absolute where b is (nearly) zero, e.g. the key gradient of a one-key softmax."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1.0)).item()


def same_block_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().sort(-1).values, b.cpu().sort(-1).values)


# Cases: 6 heads per group with Dk != Dv; GQA with two groups and batch 2; T < l (no compressed token);
# T = 1. All T are not multiples of the block sizes; the first two make real choices (more candidates than n).
CASES = {
    "h6_dk16_dv32_T45": dict(B=1, T=45, H=6, G=1, Dk=16, Dv=32,
                             cfg=NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, n_selected=3, window=24)),
    "g2_b2_T37": dict(B=2, T=37, H=4, G=2, Dk=16, Dv=16,
                      cfg=NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8,
                                    n_init_blocks=1, n_local_blocks=1)),
    "T_below_l": dict(B=1, T=11, H=2, G=1, Dk=16, Dv=16,
                      cfg=NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, n_selected=3, window=4)),
    "T1": dict(B=1, T=1, H=2, G=2, Dk=16, Dv=16, cfg=NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16,
                                                               n_selected=3, window=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nsa_matches_reference(case):
    """Invariant 1: output, all eight input gradients and the selected block sets match the float64 reference."""
    c = CASES[case]
    cfg = c["cfg"]
    inputs = make_inputs(c["B"], c["T"], c["H"], c["G"], c["Dk"], c["Dv"], cfg, seed=len(case))
    scale = c["Dk"] ** -0.5

    ref_in = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    o_ref, blocks_ref = reference.nsa_attention(*ref_in.values(), cfg, scale=scale, return_blocks=True)
    grad_out = torch.randn_like(o_ref)
    o_ref.backward(grad_out)

    tri_in = {n: x.float().to(DEVICE).requires_grad_() for n, x in inputs.items()}
    o, blocks = triton_impl.nsa_attention(*tri_in.values(), cfg, scale=scale, return_blocks=True)
    o.backward(grad_out.float().to(DEVICE))

    assert same_block_sets(blocks, blocks_ref)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) <= FP32_TOL
    for name in NAMES:
        if inputs[name].numel() == 0:  # no compressed tokens: an empty gradient is the right one
            continue
        assert torch.isfinite(tri_in[name].grad).all(), name
        assert rel_err(tri_in[name].grad, ref_in[name].grad) <= FP32_TOL, name


def _selection_and_reference(cfg, *, T, H, G, Dk, seed, launch=None):
    """(blocks, blocks_ref, lse, lse_ref) of one batch: the kernels' selection (under `launch`, else the default
    launch config) on their own compressed-branch lse, and the float64 reference's on its own."""
    inputs = make_inputs(1, T, H, G, Dk, Dk, cfg, seed=seed)
    q, k_cmp, v_cmp = inputs["q"], inputs["k_cmp"], inputs["v_cmp"]
    scale = Dk ** -0.5
    _, lse_ref = reference.compressed_attention(q, k_cmp, v_cmp, cfg, scale)
    blocks_ref = reference.select_blocks(q, k_cmp, lse_ref, cfg, scale)
    q, k_cmp, v_cmp = (x.float().to(DEVICE) for x in (q, k_cmp, v_cmp))
    _, lse = triton_impl.compressed_attention(q, k_cmp, v_cmp, cfg, scale)
    with triton_impl.use_launch_config(launch or triton_impl.launch_config()):
        blocks = triton_impl.select_blocks(q, k_cmp, lse, cfg, scale)
    return blocks, blocks_ref, lse, lse_ref


@pytest.mark.parametrize("chunk_splits,loads", [(0, "tma"), (1, "pointer"), (2, "tma")])
def test_selection_across_chunks_matches_reference(chunk_splits, loads):
    """More blocks than one chunk of the selection kernel (16, 32 or 64 blocks: n_pad = 16, the kernel's floor,
    times 2^splits; 70 blocks here): the running top-n merge, the halving of a chunk to its top n_pad, and the
    carry of compressed tokens that straddle a chunk boundary must give the reference's sets; with tiles through
    descriptors or by pointer loads."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=5, window=16, n_init_blocks=2)
    T = 560
    launch = triton_impl.LaunchConfig(select_d64=(64, chunk_splits, 4), range_loads=loads)
    blocks, blocks_ref, lse, lse_ref = _selection_and_reference(cfg, T=T, H=2, G=1, Dk=16, seed=3, launch=launch)
    assert rel_err(lse[:, cfg.cmp_block - 1:], lse_ref[:, cfg.cmp_block - 1:]) <= FP32_TOL
    assert same_block_sets(blocks, blocks_ref)
    # The kernel's order (the reference's is ascending ids): decreasing importance, so the forced blocks first,
    # lower ids first among them (all rank as +inf), and -1 last.
    valid = blocks.cpu() >= 0
    assert (valid[..., 1:] <= valid[..., :-1]).all()
    # Invariant 4 directly: |S| = min(n, |C(t)|) and the forced blocks are in S.
    t = torch.arange(T)
    count = (blocks.cpu() >= 0).sum(-1)[0, :, 0]
    assert torch.equal(count, torch.clamp(t // cfg.sel_block + 1, max=cfg.n_selected))
    chosen = blocks.cpu()[0, :, 0]
    current = t // cfg.sel_block
    for forced in (torch.zeros_like(t), torch.ones_like(t), current, current - 1):
        valid = (forced >= 0) & (forced <= current)
        assert ((chosen == forced[:, None]).any(-1) | ~valid).all()
    apart = current >= 3  # four distinct forced blocks
    assert torch.equal(chosen[apart, :4], torch.stack([0 * t, 0 * t + 1, current - 1, current], -1)[apart])


def test_selection_launch_follows_the_head_dim():
    """Head dims up to 64 take LaunchConfig.select_d64, 65 to 128 select_d128, larger ones select (v36: the paper
    shape's 16 heads of 128 run 32-block chunks, the 125M shape 16-block chunks, and head dim 192's tiles fit
    only in 16-block chunks); at head dim 128 the sets of 32-block chunks (38 blocks: two chunks) are the
    reference's."""
    cfg = NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, n_selected=5, window=16, n_init_blocks=2)
    launch = triton_impl.LaunchConfig(select=(128, 0, 8), select_d128=(64, 1, 8), select_d64=(32, 0, 4))
    with triton_impl.use_launch_config(launch):
        assert triton_impl.select_launch(64) == (32, 0, 4)
        assert triton_impl.select_launch(65) == (64, 1, 8)
        assert triton_impl.select_launch(128) == (64, 1, 8)
        assert triton_impl.select_launch(129) == (128, 0, 8)
        assert triton_impl.select_launch(192) == (128, 0, 8)
    blocks, blocks_ref, _, _ = _selection_and_reference(cfg, T=600, H=2, G=1, Dk=128, seed=5, launch=launch)
    assert same_block_sets(blocks, blocks_ref)


def test_selection_score_tile_stays_within_what_compiles_right_above_head_dim_64():
    """selection_tiles: above head dim 64 a chunk's score tile (query rows x tokens) is held to 64 x 256 elements,
    by fewer chunk splits first, then smaller query tiles (v71: 64 x 512 at head dim 128 gave wrong sets on the
    H200); head dims up to 64 keep select_d64 as it is. The paper settings (l' / d = 4, n_pad 16) are untouched."""
    launch = triton_impl.LaunchConfig(select_d128=(64, 1, 4), select_d64=(64, 0, 4))
    with triton_impl.use_launch_config(launch):
        assert triton_impl.selection_tiles(128, 16, 4) == (64, 1, 4, 128)  # paper: 32-block chunks, as before
        assert triton_impl.selection_tiles(128, 16, 8) == (64, 1, 4, 256)  # l' = 128, n = 16
        assert triton_impl.selection_tiles(128, 32, 8) == (64, 0, 4, 256)  # l' = 128, n = 32: the v71 case
        assert triton_impl.selection_tiles(128, 64, 8) == (32, 0, 4, 512)
        assert triton_impl.selection_tiles(128, 64, 16) == (16, 0, 4, 1024)
        assert triton_impl.selection_tiles(64, 64, 16) == (64, 0, 4, 1024)  # right at head dim 64 (v71)


def test_selection_with_a_smaller_query_tile_for_its_wide_chunks_matches_reference():
    """n = 33 blocks of l' / d = 8 tokens at head dim 128: a chunk of the interpreter's 128-row tiles would hold
    128 x 1024 scores, so selection_tiles runs 32-row tiles over 512-token chunks; its sets are the reference's."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=32, n_selected=33, window=16)
    assert triton_impl.selection_tiles(128, 64, 8)[0] == 32
    if ON_GPU:  # in fp32 the chunk's keys alone, 512 x 128, are 256 KB of shared memory: a clear error
        with pytest.raises(ValueError, match="select_blocks: a chunk of 512 compressed tokens .* shared memory"):
            _selection_and_reference(cfg, T=1300, H=2, G=1, Dk=128, seed=7)
        return
    blocks, blocks_ref, _, _ = _selection_and_reference(cfg, T=1300, H=2, G=1, Dk=128, seed=7)
    assert (blocks >= 0).sum(-1).max() == 33  # 41 blocks at the last query: the top-n chooses
    assert same_block_sets(blocks, blocks_ref)


@pytest.mark.parametrize("cmp_block,cmp_stride,sel_block", [(8, 4, 12), (8, 8, 16), (16, 4, 16), (8, 4, 16)])
def test_selection_block_shapes_match_reference(cmp_block, cmp_stride, sel_block):
    """Block importance for every shape of the overlap weights W: l'/d = 3 is not a power of 2, so the kernel
    takes the [tokens x blocks] matmul; the others go through the banded sum (kernels/selection.py,
    _banded_importance) with no spill into the next block (l = d), a token as long as a block (l = l'), and a
    spill of one piece. One local block only, so the block before the query's is chosen by importance too."""
    cfg = NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block, n_selected=5, window=16,
                    n_local_blocks=1)
    blocks, blocks_ref, _, _ = _selection_and_reference(cfg, T=300, H=4, G=2, Dk=16, seed=11)
    assert same_block_sets(blocks, blocks_ref)


def test_causality_under_perturbation():
    """Invariant 2: changing every input after t0 (and the compressed tokens t0 cannot see) leaves o[:, :t0+1]
    and the selection up to t0 unchanged."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8,
                    n_init_blocks=1, n_local_blocks=1)
    B, T, H, G, D, t0 = 1, 40, 2, 1, 16, 21
    base = make_inputs(B, T, H, G, D, D, cfg, seed=5, dtype=torch.float32)
    moved = make_inputs(B, T, H, G, D, D, cfg, seed=6, dtype=torch.float32)
    visible = cfg.num_cmp_tokens(t0 + 1)
    mixed = {}
    for name, x in base.items():
        x = x.clone()
        cut = visible if name in ("k_cmp", "v_cmp") else t0 + 1
        x[:, cut:] = moved[name][:, cut:]
        mixed[name] = x
    scale = D ** -0.5
    o_a, b_a = triton_impl.nsa_attention(*(x.to(DEVICE) for x in base.values()), cfg, scale=scale,
                                         return_blocks=True)
    o_b, b_b = triton_impl.nsa_attention(*(x.to(DEVICE) for x in mixed.values()), cfg, scale=scale,
                                         return_blocks=True)
    assert torch.equal(o_a[:, : t0 + 1], o_b[:, : t0 + 1])
    assert torch.equal(b_a[:, : t0 + 1], b_b[:, : t0 + 1])
    assert not torch.equal(o_a[:, t0 + 1:], o_b[:, t0 + 1:])  # the perturbation did reach the later outputs


def test_fp16_branches_match_reference():
    """Half precision in the interpreter (bf16 is only checked on the GPU: the interpreter mishandles it)."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8,
                    n_init_blocks=1, n_local_blocks=1)
    B, T, H, G, D = 1, 30, 2, 1, 16
    x = make_inputs(B, T, H, G, D, D, cfg, seed=7)
    scale = D ** -0.5
    half = {n: t.half().to(DEVICE) for n, t in x.items()}
    o_win = triton_impl.window_attention(half["q"], half["k_win"], half["v_win"], cfg.window, scale)
    o_cmp, _ = triton_impl.compressed_attention(half["q"], half["k_cmp"], half["v_cmp"], cfg, scale)
    ref_in = {n: t.half().double() for n, t in x.items()}
    assert rel_err(o_win, reference.window_attention(ref_in["q"], ref_in["k_win"], ref_in["v_win"], cfg.window,
                                                     scale)) <= 2e-3
    assert rel_err(o_cmp, reference.compressed_attention(ref_in["q"], ref_in["k_cmp"], ref_in["v_cmp"], cfg,
                                                         scale)[0]) <= 2e-3


def test_bad_inputs_are_refused():
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = make_inputs(1, 16, 2, 1, 16, 16, cfg, seed=8)  # float64: not a dtype of this backend
    with pytest.raises(ValueError, match="q: the triton backend takes"):
        triton_impl.window_attention(x["q"].to(DEVICE), x["k_win"].to(DEVICE), x["v_win"].to(DEVICE), 8, 0.25)
    with pytest.raises(ValueError, match="LaunchConfig.range_dq tiles"):
        triton_impl.LaunchConfig(range_dq=(48, 64, 4, 2))
    with pytest.raises(ValueError, match="LaunchConfig.range_fwd_d64: must be a tuple of 4"):
        triton_impl.LaunchConfig(range_fwd_d64=(64, 64, 4))
    with pytest.raises(ValueError, match="LaunchConfig.slc_kernel"):
        triton_impl.LaunchConfig(slc_kernel="tiles")
    with pytest.raises(ValueError, match="LaunchConfig.gate_kernel"):
        triton_impl.LaunchConfig(gate_kernel="fast")
    with pytest.raises(ValueError, match="LaunchConfig.range_kernel"):
        triton_impl.LaunchConfig(range_kernel="edge")
    with pytest.raises(ValueError, match="LaunchConfig.side_stream: must be a bool"):
        triton_impl.LaunchConfig(side_stream=1)
    with pytest.raises(ValueError, match="LaunchConfig.slc_block_prefetch_dims: must be an int >= 0"):
        triton_impl.LaunchConfig(slc_block_prefetch_dims=-64)
    with pytest.raises(ValueError, match="LaunchConfig.slc_block_fwd_maxnreg: must be an int >= 1"):
        triton_impl.LaunchConfig(slc_block_fwd_maxnreg=0)
    with pytest.raises(ValueError, match="LaunchConfig.slc_tile_fwd_stages_d128: must be an int >= 1"):
        triton_impl.LaunchConfig(slc_tile_fwd_stages_d128=0)
    with pytest.raises(ValueError, match="LaunchConfig.side_stream: must be a bool"):
        triton_impl.LaunchConfig(side_stream="both")
    with pytest.raises(ValueError, match="LaunchConfig.select: must be a tuple"):
        triton_impl.LaunchConfig(select=(64, -1, 8))
    with pytest.raises(ValueError, match="LaunchConfig.select_d64: must be a tuple"):
        triton_impl.LaunchConfig(select_d64=(64, 0, 6))
    with pytest.raises(ValueError, match="LaunchConfig.select query tile"):
        triton_impl.LaunchConfig(select=(48, 0, 4))
    with pytest.raises(ValueError, match="LaunchConfig.select_d128: must be a tuple"):
        triton_impl.LaunchConfig(select_d128=(64, 1))
    with pytest.raises(ValueError, match=r"dq_add: expected a contiguous torch.float32 \(1, 16, 2, 16\) tensor"):
        triton_impl._dq_scratch(torch.zeros(1, 2, 16, 16).transpose(1, 2), torch.zeros(1, 16, 2, 16))
    with pytest.raises(ValueError, match="blocks: expected int32"):
        q = x["q"].float().to(DEVICE)
        triton_impl.selected_attention(q, x["k_slc"].float().to(DEVICE), x["v_slc"].float().to(DEVICE),
                                       torch.zeros(1, 16, 1, 3, dtype=torch.int64, device=DEVICE), cfg, 0.25)


def test_auto_picks_the_selected_variant_from_static_shapes():
    """auto (kernels-notes.md v6, v11): small groups run tiled's forward with by_block's backward while a sequence
    has at most 2n blocks (125M at T = 2048: 32 blocks of 64, n = 16), by_block beyond; larger groups run tiled up
    to 16n blocks (v53; paper at T = 16384: 256 blocks), per_query beyond. 0 turns tiled_by_block off; a named
    variant is taken as it is."""
    auto = triton_impl.LaunchConfig()
    assert triton_impl.selected_kernel(6, 32, 16, auto) == "tiled_by_block"
    assert triton_impl.selected_kernel(6, 33, 16, auto) == "by_block"
    assert triton_impl.selected_kernel(8, 512, 16, auto) == "by_block"
    assert triton_impl.selected_kernel(16, 256, 16, auto) == "tiled"
    assert triton_impl.selected_kernel(16, 257, 16, auto) == "per_query"
    assert triton_impl.selected_kernel(16, 129, 16, triton_impl.LaunchConfig(slc_auto_tiled_blocks=8)) == "per_query"
    off = triton_impl.LaunchConfig(slc_auto_tiled_fwd_blocks=0)
    assert triton_impl.selected_kernel(6, 1, 16, off) == "by_block"
    assert triton_impl.selected_kernel(6, 32, 16, triton_impl.LaunchConfig(slc_kernel="per_query")) == "per_query"
    with pytest.raises(ValueError, match="LaunchConfig.slc_auto_tiled_fwd_blocks: must be an int >= 0"):
        triton_impl.LaunchConfig(slc_auto_tiled_fwd_blocks=-1)
    with pytest.raises(ValueError, match="LaunchConfig.slc_auto_tiled_blocks: must be an int >= 0"):
        triton_impl.LaunchConfig(slc_auto_tiled_blocks=-1)


@pytest.mark.parametrize("side_stream", [True, False])
def test_work_beside_the_selected_branch_runs_once_at_the_join_off_a_gpu(side_stream):
    """_Beside off CUDA (as the interpreter runs) keeps one stream: the work runs at join(), once.
    tests/test_triton_gpu.py checks the second stream on the GPU."""
    out = torch.zeros(3)
    calls = []

    def work():
        calls.append(len(calls))
        out.add_(1)

    with triton_impl.use_launch_config(triton_impl.LaunchConfig(side_stream=side_stream)):
        beside = triton_impl._Beside(torch.device("cpu"), work)
        assert calls == []
        beside.join()
    assert calls == [0] and torch.equal(out, torch.ones(3))


SELECTED_VARIANTS = {
    "per_query": dict(slc_kernel="per_query", slc_dkdv="inverted", slc_query_dq="recompute"),
    "tiled16": dict(slc_kernel="tiled", slc_tile_rows=16, slc_dkdv="inverted", slc_query_dq="recompute"),
    # dK/dV of the query-driven variants by the by_block kernel (no dQ), 2 choosers of 6 heads per 16 rows
    "tiled64_dkdv_by_block": dict(slc_kernel="tiled", slc_tile_rows=64, slc_dkdv="by_block", slc_block_rows=16,
                                  slc_block_chunk=8, slc_query_dq="recompute"),
    # 16 rows hold 2 choosers of 6 heads (4 rows idle); chunks of 8 choosers split the busy blocks over programs
    "by_block16_partial": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8),
    "by_block64_atomic": dict(slc_kernel="by_block", slc_block_rows=64, slc_block_chunk=16, slc_dq="atomic"),
    # each step loads the next step's choosers (and the backward its do, lse and delta rows) ahead of its own work
    "by_block16_no_prefetch": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=16,
                                   slc_block_prefetch_dims=0),
    # tiled's forward (its lse feeds by_block's backward), by_block's backward over the saved work list
    "tiled_by_block": dict(slc_kernel="tiled_by_block", slc_tile_rows=16, slc_block_rows=16, slc_block_chunk=8),
    # tiled's dQ from the ds by_block's dK/dV stores at each slot (one product a union block)
    "tiled64_dq_from_ds": dict(slc_kernel="tiled", slc_tile_rows=64, slc_dkdv="by_block", slc_query_dq="ds",
                               slc_block_rows=16, slc_block_chunk=8),
    "per_query_dq_from_ds": dict(slc_kernel="per_query", slc_dkdv="by_block", slc_query_dq="ds", slc_block_rows=16,
                                 slc_block_chunk=8),
}


# Every variant on random choices through descriptors; structured choices for the variants whose work follows the
# sharing (tiled's unions, by_block's chooser lists); pointer loads once for each kernel that reads key blocks.
SHARING_VARIANTS = ("tiled16", "tiled64_dkdv_by_block", "by_block16_partial", "by_block64_atomic", "tiled_by_block",
                    "tiled64_dq_from_ds")
POINTER_VARIANTS = ("per_query", "tiled16", "by_block16_partial", "tiled64_dq_from_ds", "per_query_dq_from_ds")
SELECTED_CASES = ([(variant, False, "tma") for variant in SELECTED_VARIANTS]
                  + [(variant, True, "tma") for variant in SHARING_VARIANTS]
                  + [(variant, False, "pointer") for variant in POINTER_VARIANTS])


@pytest.mark.parametrize("variant,structured,loads", SELECTED_CASES)
def test_selected_variants_match_reference(variant, structured, loads):
    """Every selected-attention variant (per query; per tile of queries walking the union of their blocks; per
    key block over its choosers, with dQ by slot sums or atomics), forward and all three gradients, on random
    choices (large unions, -1 padding, blocks after t) and on structured ones (neighbouring queries share most
    blocks, as in trained models); each block's keys through descriptors or by pointer loads."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 2, 43, 6, 2, 16, 32
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=11)
    blocks = _choices(B, T, G, cfg, structured, seed=12)
    check_selected_against_reference(x, blocks, cfg, triton_impl.LaunchConfig(
        dkdv_rows=32, dkdv_chunk=64, range_loads=loads, **SELECTED_VARIANTS[variant]))


@pytest.mark.parametrize("H, G, rows, structured", [(8, 2, 16, False), (12, 2, 16, False), (32, 2, 64, False),
                                                    (32, 2, 64, True)])
@pytest.mark.parametrize("kernel", ["tiled", "per_query"])
def test_query_dq_from_stored_ds_matches_reference(H, G, rows, structured, kernel):
    """slc_query_dq = "ds": by_block's dK/dV stores each (query, block) slot's ds. tiled's dQ multiplies the union's
    keys by its member rows' ds, finding each row's slot among its query's choices; per_query's multiplies each
    slot's keys by the slot's ds. Tiles of 4 queries of 4 heads, 2 queries of 6 heads, and 4 of 16 (the paper's
    groups); random choices with -1 padding and blocks after t, or shared by runs of queries; Dk != Dv."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    T, Dk, Dv = 37, 16, 32
    x = make_inputs(1, T, H, G, Dk, Dv, cfg, seed=H)
    blocks = _choices(1, T, G, cfg, structured, seed=H + 1)
    check_selected_against_reference(x, blocks, cfg, triton_impl.LaunchConfig(
        slc_kernel=kernel, slc_tile_rows=rows, slc_query_dq="ds", slc_dkdv="by_block", slc_block_rows=16,
        slc_block_chunk=8))


def test_query_dq_from_stored_ds_needs_by_blocks_dkdv():
    """slc_query_dq = "ds" reads what by_block's dK/dV writes: with the inverted-index dK/dV it is refused up front."""
    with pytest.raises(ValueError, match="slc_query_dq='ds' reads the ds that by_block's dK/dV stores"):
        triton_impl.LaunchConfig(slc_query_dq="ds", slc_dkdv="inverted")


def _choices(B, T, G, cfg, structured, seed):
    """[B, T, G, 3] int32: each query's own block, then two other distinct blocks (possibly after the query, or
    -1 where not structured); structured: the two shared by each run of 8 queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (T + cfg.sel_block - 1) // cfg.sel_block
    runs = (T + 7) // 8 if structured else T
    others = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:2] for _ in range(B * runs * G)])
    others = others.view(B, runs, G, 2)
    if structured:
        others = others.repeat_interleave(8, dim=1)[:, :T]
    current = (torch.arange(T) // cfg.sel_block).view(1, T, 1, 1).expand(B, T, G, 1)
    others = (current + 1 + others) % num_blocks
    if not structured:
        others = torch.where(torch.rand(others.shape, generator=gen) < 0.2, -1, others)
    return torch.cat([current, others], dim=-1).to(torch.int32)


def check_selected_against_reference(x, blocks, cfg, launch):
    """The selected branch under `launch`, forward and the gradients of q, k and v, against the reference's."""
    scale = x["q"].shape[-1] ** -0.5
    ref_in = [x[n].clone().requires_grad_() for n in ("q", "k_slc", "v_slc")]
    o_ref = reference.selected_attention(*ref_in, blocks.long(), cfg, scale)
    grad_out = torch.randn_like(o_ref)
    o_ref.backward(grad_out)
    tri_in = [x[n].float().to(DEVICE).requires_grad_() for n in ("q", "k_slc", "v_slc")]
    with triton_impl.use_launch_config(launch):
        o = triton_impl.selected_attention(*tri_in, blocks.to(DEVICE), cfg, scale)
        o.backward(grad_out.float().to(DEVICE))
    assert rel_err(o, o_ref) <= FP32_TOL
    for name, a, r in zip(("dq", "dk", "dv"), tri_in, ref_in):
        assert rel_err(a.grad, r.grad) <= FP32_TOL, name


def test_offsets_64_counts_a_tensors_span_by_its_strides():
    """The by_block kernels' element offsets are int32 unless some tensor spans more than _INT32_SPAN elements from
    its first to its last, by its strides: a view of few elements can span many."""
    big = torch.empty(3, 2 ** 30, device="meta")
    assert triton_impl._offsets_64(torch.empty(2 ** 31, device="meta"))
    assert not triton_impl._offsets_64(torch.empty(2 ** 30, device="meta"), torch.empty(0, 5, device="meta"))
    assert triton_impl._offsets_64(torch.empty(4), big[:, :10])  # 30 elements, 2^31 + 10 apart
    assert not triton_impl._offsets_64(big[:2, :10])


@pytest.mark.parametrize("variant", ["by_block16_partial", "by_block64_atomic", "tiled64_dkdv_by_block"])
def test_by_block_kernels_with_64_bit_offsets_match_reference(variant, monkeypatch):
    """OFFSETS_64 (taken where a tensor passes 2^31 elements, as at paper 1 x 64k) forced by a span limit of 100
    elements: forward and gradients against the reference, and every by_block launch took the int64 path."""
    monkeypatch.setattr(triton_impl, "_INT32_SPAN", 100)
    taken = []
    offsets_64 = triton_impl._offsets_64

    def recorded(*tensors):
        taken.append(offsets_64(*tensors))
        return taken[-1]
    monkeypatch.setattr(triton_impl, "_offsets_64", recorded)
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 2, 43, 6, 2, 16, 32
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=13)
    num_blocks = (T + cfg.sel_block - 1) // cfg.sel_block
    gen = torch.Generator().manual_seed(14)
    # the query's own block and two other distinct ones, possibly after it
    others = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:2] for _ in range(B * T * G)])
    current = (torch.arange(T) // cfg.sel_block).view(1, T, 1, 1).expand(B, T, G, 1)
    blocks = torch.cat([current, (current + 1 + others.view(B, T, G, 2)) % num_blocks], dim=-1).to(torch.int32)
    check_selected_against_reference(x, blocks, cfg, triton_impl.LaunchConfig(**SELECTED_VARIANTS[variant]))
    assert taken and all(taken)


@pytest.mark.parametrize("variant", ["by_block16_partial", "tiled_by_block", "tiled64_dkdv_by_block"])
def test_selected_forward_refuses_a_scale_that_is_not_positive(variant):
    """by_block's forward scales a row's maximum score after taking it and its backward takes log2(scale), right
    only for a positive scale; the variants that run only by_block's backward refuse it in the forward too."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = make_inputs(1, 16, 6, 2, 16, 16, cfg, seed=15)
    blocks = (torch.arange(16) // 8).view(1, 16, 1, 1).expand(1, 16, 2, 3).contiguous().to(torch.int32)
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(**SELECTED_VARIANTS[variant])):
        with pytest.raises(ValueError, match="positive softmax scale, got -0.25"):
            triton_impl.selected_attention(*(x[n].float().to(DEVICE) for n in ("q", "k_slc", "v_slc")),
                                           blocks.to(DEVICE), cfg, -0.25)


@pytest.mark.parametrize("branch", ["window", "compressed"])
def test_range_forward_refuses_a_scale_that_is_not_positive(branch):
    """The range forward scales a row's maximum score after taking it (the scale inside the exponential's FMA),
    right only for a positive scale."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = {n: t.float().to(DEVICE) for n, t in make_inputs(1, 16, 6, 2, 16, 16, cfg, seed=15).items()}
    with pytest.raises(ValueError, match="positive softmax scale, got -0.25"):
        if branch == "window":
            triton_impl.window_attention(x["q"], x["k_win"], x["v_win"], cfg.window, -0.25)
        else:
            triton_impl.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, -0.25)


# Every pair of the three settings' values once (6 cases, not the 12 of the full cross): each step shape with and
# without prefetch and with and without later blocks, and prefetch with and without later blocks.
@pytest.mark.parametrize("rows,chunk,prefetch_dims,later_blocks", [
    (16, 7, 64, False), (16, 7, 0, True), (16, 16, 64, True), (16, 16, 0, False), (64, 16, 64, False),
    (64, 16, 0, True)])
def test_by_block_steps_skip_the_mask_only_where_every_chooser_sees_the_whole_block(rows, chunk, prefetch_dims,
                                                                                   later_blocks):
    """With the selection block as wide as the kernels' key tile (16), by_block's forward steps whose choosers all sit
    at or after their block's last key run without the causal mask (a second loop; the backward masks every step). Each query chooses its own block and
    up to two earlier ones, so a block's chooser list starts with its own queries (masked) and goes on with later
    ones. Steps of 5 or 21 choosers in chunks of 7 or 16 start on many positions of a block, among them its last two
    queries (the mask's edge); the sequence's last block is partial. later_blocks: a third of the queries choose a
    block after their own (or an id past the sequence) instead of an earlier one; such a block holds nothing for
    them, and as choosers they would sort before the block's own queries and push those out of the masked steps,
    unless selected_attention drops them first. Forward and the three gradients against the reference."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 2, 75, 6, 2, 16, 32
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=31)
    gen = torch.Generator().manual_seed(32)
    current = torch.arange(T) // cfg.sel_block
    num_blocks = int(current[-1]) + 1
    rows_of_blocks = []
    for _ in range(B * G):
        per_query = []
        for t in range(T):
            earlier = torch.randperm(int(current[t]), generator=gen)[:2].tolist() if current[t] else []
            choice = [int(current[t])] + earlier + [-1] * (2 - len(earlier))
            if later_blocks and t % 3 == 0:  # after the own block, up to one id past the last block
                choice[2] = int(current[t]) + 1 + int(torch.randint(num_blocks - int(current[t]), (1,),
                                                                    generator=gen))
            per_query.append(choice)
        rows_of_blocks.append(per_query)
    blocks = torch.tensor(rows_of_blocks, dtype=torch.int32).view(B, G, T, 3).transpose(1, 2).contiguous()
    check_selected_against_reference(x, blocks, cfg, triton_impl.LaunchConfig(
        slc_kernel="by_block", slc_block_rows=rows, slc_block_chunk=chunk, slc_block_prefetch_dims=prefetch_dims))


CORE_VARIANTS = {  # the per-query ones sum the gated output in their forward's epilogue (paper 32k-64k's variant)
    "per_query": dict(slc_kernel="per_query", slc_dkdv="inverted", slc_query_dq="recompute"),
    "per_query_dkdv_by_block": dict(slc_kernel="per_query", slc_dkdv="by_block", slc_block_rows=16,
                                    slc_block_chunk=8, slc_query_dq="recompute"),
    "tiled_torch_gates": dict(slc_kernel="tiled", slc_tile_rows=64, gate_kernel="torch"),
    # the paper shapes' variant: tiled dQ adding into the two ranges' dQ (ACCUMULATE), by_block's dK/dV
    "tiled_dkdv_by_block": dict(slc_kernel="tiled", slc_tile_rows=16, slc_dkdv="by_block", slc_block_rows=16,
                                slc_block_chunk=8, slc_query_dq="recompute"),
    # the same with tiled's dQ from by_block's stored ds
    # (range_dq_last: the two ranges' dQ after the selected backward, added into its dq; or before it, the
    # selected dQ adding theirs into its own)
    "tiled_dq_from_ds": dict(slc_kernel="tiled", slc_tile_rows=16, slc_dkdv="by_block", slc_query_dq="ds",
                             slc_block_rows=16, slc_block_chunk=8),
    "tiled_dq_from_ds_range_dq_first": dict(slc_kernel="tiled", slc_tile_rows=16, slc_dkdv="by_block",
                                            slc_query_dq="ds", slc_block_rows=16, slc_block_chunk=8,
                                            range_dq_last=False),
    "per_query_dq_from_ds": dict(slc_kernel="per_query", slc_dkdv="by_block", slc_query_dq="ds", slc_block_rows=16,
                                 slc_block_chunk=8),
    "by_block_partial": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8),
    "by_block_atomic": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8, slc_dq="atomic"),
    "by_block_no_prefetch": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=16,
                                 slc_block_prefetch_dims=0),
    "tiled_by_block": dict(slc_kernel="tiled_by_block", slc_tile_rows=16, slc_block_rows=16, slc_block_chunk=8),
    # the others run the compressed and window branches' dQ as one two-range launch (range_pair "fused", with the
    # fused gates); this one, and tiled_torch_gates (whose branches get different d o_i), apart
    "by_block_ranges_apart": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8, range_pair="apart"),
    # the atomics add into the two ranges' dQ, summed in float32 beforehand
    "by_block_atomic_ranges_apart": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8, slc_dq="atomic",
                                         range_pair="apart"),
    # by_block's dQ slots summed by a pass of their own (which adds the two ranges' dQ), not in the epilogue of the
    # two ranges' dQ kernel (slc_slot_sum "range_dq", the default the variants above run)
    "by_block_slot_sum_pass": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8, slc_slot_sum="pass"),
    "tiled_by_block_slot_sum_pass": dict(slc_kernel="tiled_by_block", slc_tile_rows=16, slc_block_rows=16,
                                         slc_block_chunk=8, slc_slot_sum="pass"),
    # by_block's partials combined, and the gates summed, by a pass each, not the gated sum in the combine pass's
    # epilogue (slc_combine "gated", the default the by_block variants above run)
    "by_block_combine_plain": dict(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8, slc_combine="plain"),
}


@pytest.mark.parametrize("slot_sum, variant", [("range_dq", {}), ("pass", {}),
                                               ("range_dq", dict(range_pair="apart"))])
def test_slot_sum_runs_in_the_range_dq_kernel_where_asked_and_possible(slot_sum, variant, monkeypatch):
    """slc_slot_sum = "range_dq": nsa::core's backward hands by_block's dQ slots to the two ranges' dQ kernel and
    runs no slot-sum pass; it keeps the pass where that kernel is not one launch for both ranges. The variant test
    above checks the values."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = {n: t.float().to(DEVICE).requires_grad_() for n, t in make_inputs(1, 29, 6, 2, 16, 32, cfg, seed=4).items()}
    seen = {"slot_sum_pass": 0, "range_dq_with_slots": 0}
    real_sum, real_dq = triton_impl.selected_dq_sum_kernel, triton_impl._range_dq_into

    class CountedSum:
        def __getitem__(self, grid):
            seen["slot_sum_pass"] += 1
            return real_sum[grid]

    def dq_into(*args, slots=None, **kwargs):
        seen["range_dq_with_slots"] += slots is not None
        return real_dq(*args, slots=slots, **kwargs)
    monkeypatch.setattr(triton_impl, "selected_dq_sum_kernel", CountedSum())
    monkeypatch.setattr(triton_impl, "_range_dq_into", dq_into)
    launch = triton_impl.LaunchConfig(slc_kernel="by_block", slc_block_rows=16, slc_block_chunk=8,
                                      slc_slot_sum=slot_sum, **variant)
    with triton_impl.use_launch_config(launch):
        triton_impl.nsa_attention(*x.values(), cfg, scale=0.25).square().sum().backward()
    in_range = slot_sum == "range_dq" and not variant
    assert seen == {"slot_sum_pass": 0 if in_range else 1, "range_dq_with_slots": 1 if in_range else 0}


@pytest.mark.parametrize("combine, variant", [("gated", {}), ("plain", {}), ("gated", dict(gate_kernel="torch"))])
def test_gates_are_summed_in_the_combine_pass_where_asked_and_possible(combine, variant, monkeypatch):
    """slc_combine = "gated": nsa::core's forward runs by_block's combine with the gated sum in its epilogue and no
    gate pass. It keeps the gate pass with the torch gates.
    Either way the core's output and the selected branch's output and lse
    (what the backward reads) are those of the separate passes (exactly, in the interpreter); the variant tests
    check the gradients."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = [t.float().to(DEVICE) for t in make_inputs(1, 29, 6, 2, 16, 32, cfg, seed=5).values()]
    seen = {"plain_combine": 0, "gated_combine": 0, "gate_pass": 0}
    real_combine, real_gates = triton_impl.selected_combine_kernel, triton_impl.gated_sum_fwd_kernel

    class CountedCombine:
        def __getitem__(self, grid):
            def launch(*args, GATED=False, **kwargs):
                seen["gated_combine" if GATED else "plain_combine"] += 1
                return real_combine[grid](*args, GATED=GATED, **kwargs)
            return launch

    class CountedGates:
        def __getitem__(self, grid):
            seen["gate_pass"] += 1
            return real_gates[grid]
    monkeypatch.setattr(triton_impl, "selected_combine_kernel", CountedCombine())
    monkeypatch.setattr(triton_impl, "gated_sum_fwd_kernel", CountedGates())
    outs, counts = {}, {}
    for which in (combine, "plain"):
        seen.update(dict.fromkeys(seen, 0))
        launch = triton_impl.LaunchConfig(**{"slc_kernel": "by_block", "slc_block_rows": 16, "slc_block_chunk": 8,
                                             "slc_combine": which, **variant})
        with triton_impl.use_launch_config(launch):
            core = torch.ops.nsa.core(*x, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window,
                                      cfg.n_init_blocks, cfg.n_local_blocks, 0.25, False)
        outs[which], counts[which] = [core[i] for i in (0, 4, 5)], dict(seen)  # o, o_slc, lse_slc
    gated = combine == "gated" and not variant
    assert counts[combine] == {"plain_combine": 0 if gated else 1, "gated_combine": 1 if gated else 0,
                               "gate_pass": 0 if gated or variant.get("gate_kernel") == "torch" else 1}
    for name, a, b in zip(("o", "o_slc", "lse_slc"), outs[combine], outs["plain"]):
        if ON_GPU:
            assert rel_err(a, b) <= 1e-6, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kernel, launcher", [("tiled", "selected_tiled_fwd_kernel"),
                                              ("tiled_by_block", "selected_tiled_fwd_kernel"),
                                              ("per_query", "selected_attn_fwd_kernel")])
@pytest.mark.parametrize("combine", ["gated", "plain"])
def test_gates_are_summed_in_the_query_driven_forward_where_asked(combine, kernel, launcher, monkeypatch):
    """slc_combine = "gated" with tiled, tiled_by_block (tiled's forward) or per_query: nsa::core's forward sums
    the gated output in the selected forward's epilogue and runs no gate pass; "plain" keeps the pass. The core's
    output and the selected branch's output and lse are those of the separate passes (exactly, in the
    interpreter); the core variant test checks the gradients."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    x = [t.float().to(DEVICE) for t in make_inputs(1, 29, 6, 2, 16, 32, cfg, seed=6).values()]
    seen = {"slc_gated": 0, "slc_plain": 0, "gate_pass": 0}
    real_slc, real_gates = getattr(triton_impl, launcher), triton_impl.gated_sum_fwd_kernel

    class CountedSelected:
        def __getitem__(self, grid):
            def launch(*args, GATED=False, **kwargs):
                seen["slc_gated" if GATED else "slc_plain"] += 1
                return real_slc[grid](*args, GATED=GATED, **kwargs)
            return launch

    class CountedGates:
        def __getitem__(self, grid):
            seen["gate_pass"] += 1
            return real_gates[grid]
    monkeypatch.setattr(triton_impl, launcher, CountedSelected())
    monkeypatch.setattr(triton_impl, "gated_sum_fwd_kernel", CountedGates())
    outs, counts = {}, {}
    for which in (combine, "plain"):
        seen.update(dict.fromkeys(seen, 0))
        with triton_impl.use_launch_config(triton_impl.LaunchConfig(slc_kernel=kernel, slc_tile_rows=16,
                                                                    slc_combine=which)):
            core = torch.ops.nsa.core(*x, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window,
                                      cfg.n_init_blocks, cfg.n_local_blocks, 0.25, False)
        outs[which], counts[which] = [core[i] for i in (0, 4, 5)], dict(seen)  # o, o_slc, lse_slc
    gated = combine == "gated"
    assert counts[combine] == {"slc_gated": int(gated), "slc_plain": int(not gated), "gate_pass": int(not gated)}
    for name, a, b in zip(("o", "o_slc", "lse_slc"), outs[combine], outs["plain"]):
        if ON_GPU:
            assert rel_err(a, b) <= 1e-6, name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kernel", ["per_query", "tiled"])
def test_selected_query_kernels_take_their_own_pipeline_stages(kernel, monkeypatch):
    """The per-query forward and dQ launch with LaunchConfig.slc_stages, the tiled ones with slc_tile_stages (the
    tiled forward at head dims <= 64): v37's sweep found 3 stages best for the per-query kernels at paper 16k-64k,
    where they cost the tiled dQ 11% at paper 8k. Values against the reference at both settings."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    inputs = make_inputs(1, 29, 4, 2, 16, 16, cfg, seed=8)
    o_ref, ref_in, grad_out = reference_with_grads(inputs, cfg, 0.25)
    names = {"per_query": ("selected_attn_fwd_kernel", "selected_attn_bwd_dq_kernel"),
             "tiled": ("selected_tiled_fwd_kernel", "selected_tiled_bwd_dq_kernel")}[kernel]
    stages = {}

    class Recorded:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __getitem__(self, grid):
            def launch(*args, num_stages=None, **kwargs):
                stages[self.name] = num_stages
                return self.real[grid](*args, num_stages=num_stages, **kwargs)
            return launch
    for name in names:
        monkeypatch.setattr(triton_impl, name, Recorded(name, getattr(triton_impl, name)))
    launch = triton_impl.LaunchConfig(slc_kernel=kernel, slc_stages=5, slc_tile_stages=1, slc_dkdv="inverted",
                                      slc_query_dq="recompute",
                                      dkdv_rows=32, dkdv_chunk=64)
    x = {n: t.float().to(DEVICE).requires_grad_() for n, t in inputs.items()}
    with triton_impl.use_launch_config(launch):
        o = triton_impl.nsa_attention(*x.values(), cfg, scale=0.25)
        o.backward(grad_out.float().to(DEVICE))
    assert stages == dict.fromkeys(names, 5 if kernel == "per_query" else 1)
    assert rel_err(o, o_ref) <= FP32_TOL
    for name in NAMES:
        assert rel_err(x[name].grad, ref_in[name].grad) <= FP32_TOL, name


def reference_with_grads(inputs, cfg, scale):
    """(o, the inputs as leaves holding their gradients, the output gradient used) of the float64 reference."""
    ref_in = {n: x.clone().requires_grad_() for n, x in inputs.items()}
    o_ref = reference.nsa_attention(*ref_in.values(), cfg, scale=scale)
    grad_out = torch.randn_like(o_ref)
    o_ref.backward(grad_out)
    return o_ref, ref_in, grad_out


@pytest.mark.parametrize("variant", list(CORE_VARIANTS))
def test_core_op_backward_matches_reference_under_every_variant(variant, monkeypatch):
    """nsa::core_bwd takes each branch's row term from the gate backward and folds the compressed and window dQ
    into the selected branch's (by_block: its dQ slots summed in the range dQ kernel, or the range dQ added by the
    slot-sum pass): all eight gradients against the reference, under every selected variant and both gate
    kernels. The K/V sets are sliced from one [B, T, sets, G, D] tensor (tokens 3 * G * D elements apart; how
    NSAAttention handed them over before rope_split gave each set its own tensor): every kernel reads them where
    they lie at that row pitch (no copy of any K/V set is made), and the set no branch reads gets no gradient."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 1, 29, 6, 2, 16, 32
    inputs = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=21)
    scale = Dk ** -0.5
    o_ref, ref_in, grad_out = reference_with_grads(inputs, cfg, scale)

    # sets in the model's order (cmp, slc, win); the compressed set stays a separate tensor, as phi's output is
    stacked_k = torch.stack([torch.zeros_like(inputs["k_slc"]), inputs["k_slc"], inputs["k_win"]], dim=2)
    stacked_v = torch.stack([torch.zeros_like(inputs["v_slc"]), inputs["v_slc"], inputs["v_win"]], dim=2)
    stacked_k = stacked_k.float().to(DEVICE).requires_grad_()
    stacked_v = stacked_v.float().to(DEVICE).requires_grad_()
    _, k_slc, k_win = stacked_k.unbind(2)
    _, v_slc, v_win = stacked_v.unbind(2)
    rest = {n: inputs[n].float().to(DEVICE).requires_grad_() for n in ("q", "k_cmp", "v_cmp", "gates")}
    copied = []
    contiguous = torch.Tensor.contiguous

    def recording_contiguous(self, *args, **kwargs):
        if not self.is_contiguous() and self.dim() == 4 and self.shape[1] == T and self.shape[2] == G:
            copied.append(tuple(self.shape))
        return contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", recording_contiguous)
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(dkdv_rows=32, dkdv_chunk=64,
                                                                **CORE_VARIANTS[variant])):
        o = triton_impl.nsa_attention(rest["q"], k_slc, v_slc, k_win, v_win, rest["k_cmp"], rest["v_cmp"],
                                      rest["gates"], cfg, scale=scale)
        o.backward(grad_out.float().to(DEVICE))
    monkeypatch.undo()
    assert not k_slc.is_contiguous() and copied == []
    assert rel_err(o, o_ref) <= FP32_TOL
    grads = {"k_slc": stacked_k.grad[:, :, 1], "k_win": stacked_k.grad[:, :, 2], "v_slc": stacked_v.grad[:, :, 1],
             "v_win": stacked_v.grad[:, :, 2], **{n: x.grad for n, x in rest.items()}}
    for name in NAMES:
        assert rel_err(grads[name], ref_in[name].grad) <= FP32_TOL, name
    assert stacked_k.grad[:, :, 0].abs().max() == 0 and stacked_v.grad[:, :, 0].abs().max() == 0


def test_large_selection_blocks_are_attended_as_equal_parts():
    """attend_geometry: selection blocks above _SLC_ATTEND_BLOCK (64) keys are attended as the fewest equal parts
    of at most 64 keys; _attended_blocks maps block j to parts j f .. j f + f - 1, keeps -1, and drops a part that
    starts after its query."""
    assert triton_impl.attend_geometry(64, 16) == (64, 16)
    assert triton_impl.attend_geometry(32, 8) == (32, 8)
    assert triton_impl.attend_geometry(128, 16) == (64, 32)
    assert triton_impl.attend_geometry(96, 8) == (48, 16)
    assert triton_impl.attend_geometry(144, 4) == (48, 12)  # 144 = 3 x 48: two parts would not be equal
    assert triton_impl.attend_geometry(256, 3) == (64, 12)
    blocks = torch.full((1, 300, 1, 3), -1, dtype=torch.int32)
    blocks[0, 299, 0] = torch.tensor([2, 0, -1])  # query 299: block 2 holds 256 .. 383, its second part past it
    blocks[0, 130, 0, 0] = 1
    parts, part = triton_impl._attended_blocks(blocks, 128)
    assert part == 64 and parts.shape == (1, 300, 1, 6)
    assert parts[0, 299, 0].tolist() == [4, -1, 0, 1, -1, -1]
    assert parts[0, 130, 0].tolist() == [2, -1, -1, -1, -1, -1]  # 128 .. 191 starts by 130, 192 .. 255 after
    assert parts[0, 0, 0].tolist() == [-1] * 6
    same, part = triton_impl._attended_blocks(blocks, 64)
    assert same is blocks and part == 64


@pytest.mark.parametrize("variant", ["by_block", "tiled_by_block", "tiled", "per_query"])
def test_selection_blocks_attended_in_parts_match_reference(variant, monkeypatch):
    """l' = 48 attended as three parts of 16 keys (_SLC_ATTEND_BLOCK set to 16 here, as 64 splits l' = 128 on the
    GPU): the output, all eight gradients and the selected sets of nsa::core against the float64 reference, under
    each selected variant; and selected_attention through its public entry."""
    monkeypatch.setattr(triton_impl, "_SLC_ATTEND_BLOCK", 16)
    cfg = NSAConfig(cmp_block=16, cmp_stride=8, sel_block=48, n_selected=3, window=24)
    B, T, H, G, Dk, Dv = 1, 150, 4, 2, 16, 16  # 4 blocks of 48 at the last queries, 3 chosen
    inputs = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=31)
    scale = Dk ** -0.5
    o_ref, ref_in, grad_out = reference_with_grads(inputs, cfg, scale)
    tri_in = {n: x.float().to(DEVICE).requires_grad_() for n, x in inputs.items()}
    launch = triton_impl.LaunchConfig(slc_kernel=variant, dkdv_rows=32, dkdv_chunk=64, slc_block_rows=16,
                                      slc_block_chunk=8, slc_tile_rows=16)
    with triton_impl.use_launch_config(launch):
        o, blocks = triton_impl.nsa_attention(*tri_in.values(), cfg, scale=scale, return_blocks=True)
        o.backward(grad_out.float().to(DEVICE))
        blocks_ref = reference.select_blocks(ref_in["q"].detach(), ref_in["k_cmp"].detach(),
                                             reference.compressed_attention(ref_in["q"].detach(),
                                                                            ref_in["k_cmp"].detach(),
                                                                            ref_in["v_cmp"].detach(), cfg, scale)[1],
                                             cfg, scale)
        assert blocks.shape[-1] == 3 and same_block_sets(blocks, blocks_ref)  # the caller sees l' blocks
        assert rel_err(o, o_ref) <= FP32_TOL
        for name in NAMES:
            assert rel_err(tri_in[name].grad, ref_in[name].grad) <= FP32_TOL, name
        q, k, v = (inputs[n].float().to(DEVICE) for n in ("q", "k_slc", "v_slc"))
        o_slc = triton_impl.selected_attention(q, k, v, blocks, cfg, scale)
    want = reference.selected_attention(inputs["q"], inputs["k_slc"], inputs["v_slc"], blocks.long().cpu(), cfg,
                                        scale)
    assert rel_err(o_slc, want) <= FP32_TOL


@pytest.mark.parametrize("gate_kernel", ["fused", "torch"])
def test_core_bwd_with_gates_of_zero_and_one_matches_reference(gate_kernel):
    """The fused gate backward puts each gate into its branch's log-sum-exp (lse - ln g, kernels/gates.py): a gate
    of 0 makes that +inf, also on rows whose compressed branch sees no key (lse = -inf there, which must stay
    -inf, not become NaN). Gates of exactly 0 and 1 on a third of the rows each, T short enough that the first
    queries see no compressed token: all gradients finite and equal to the reference's."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 1, 29, 6, 2, 16, 32
    inputs = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=31)
    pick = torch.rand(inputs["gates"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs["gates"] = torch.where(pick < 1 / 3, 0.0, torch.where(pick > 2 / 3, 1.0, inputs["gates"]))
    assert (inputs["gates"][:, :cfg.cmp_block - 1, :, 0] == 0).any()  # a zero gate where cmp sees no key
    scale = Dk ** -0.5
    o_ref, ref_in, grad_out = reference_with_grads(inputs, cfg, scale)
    tri_in = {n: x.float().to(DEVICE).requires_grad_() for n, x in inputs.items()}
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(gate_kernel=gate_kernel)):
        o = triton_impl.nsa_attention(*tri_in.values(), cfg, scale=scale)
        o.backward(grad_out.float().to(DEVICE))
    assert rel_err(o, o_ref) <= FP32_TOL
    for name in NAMES:
        assert torch.isfinite(tri_in[name].grad).all(), name
        assert rel_err(tri_in[name].grad, ref_in[name].grad) <= FP32_TOL, name


def test_fused_gate_backward_folds_each_gate_into_its_branch_lse():
    """_gated_bwd(lse=...) gives dgates, the row terms rowsum(do * o_i) and lse_i - ln g_i: +inf where g = 0 (the
    branch then has no gradient), -inf kept where the branch saw no key (lse = -inf), also with g = 0 there."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, Dv = 2, 5, 3, 8
    gates = torch.rand(B, T, H, 3, generator=gen)
    gates[0, 0, 0] = 0.0
    outs = [torch.randn(B, T, H, Dv, generator=gen) for _ in range(3)]
    do = torch.randn(B, T, H, Dv, generator=gen)
    lse = [torch.randn(B, T, H, generator=gen) for _ in range(3)]
    lse[0][0, 0, :2] = float("-inf")  # head 0: g = 0 and no key; head 1: g > 0 and no key
    dev = [x.to(DEVICE) for x in (gates, *outs, do)]
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(gate_kernel="fused")):
        dgates, delta, lse_g = triton_impl._gated_bwd(*dev, lse=[x.to(DEVICE) for x in lse])
    rowterms = torch.stack([(do * o).sum(-1) for o in outs])
    assert torch.allclose(delta.cpu(), rowterms, rtol=1e-5, atol=1e-5)
    assert torch.allclose(dgates.cpu(), rowterms.permute(1, 2, 3, 0), rtol=1e-5, atol=1e-5)
    expected = torch.stack(lse) - torch.log(gates.permute(3, 0, 1, 2))
    expected[0, 0, 0, :2] = float("-inf")
    assert lse_g[0, 0, 0, 0].item() == float("-inf") and lse_g[0, 0, 0, 1].item() == float("-inf")
    assert lse_g[1, 0, 0, 0].item() == float("inf")  # g = 0 (all three gates of that row), lse finite
    assert torch.allclose(lse_g.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_core_backward_in_half_precision_matches_reference():
    """fp16 (the interpreter has no bf16): every gradient of nsa::core against float64 on the same rounded inputs.
    In 16 bits the dK/dV accumulators of the selected and compressed branches share one float32 buffer and are
    cast apart at the end, and the gate gradient is written in the inputs' dtype by the kernel."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 1, 29, 6, 2, 16, 32
    inputs = {n: x.half() for n, x in make_inputs(B, T, H, G, Dk, Dv, cfg, seed=25).items()}
    scale = Dk ** -0.5
    ref_in = {n: x.double().requires_grad_() for n, x in inputs.items()}
    o_ref = reference.nsa_attention(*ref_in.values(), cfg, scale=scale)
    grad_out = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(26), dtype=torch.float64).half()
    o_ref.backward(grad_out.double())
    tri_in = {n: x.to(DEVICE).requires_grad_() for n, x in inputs.items()}
    o = triton_impl.nsa_attention(*tri_in.values(), cfg, scale=scale)
    o.backward(grad_out.to(DEVICE))
    assert rel_err(o, o_ref) <= 5e-3
    for name in NAMES:
        assert tri_in[name].grad.dtype == torch.float16, name
        assert rel_err(tri_in[name].grad, ref_in[name].grad) <= 1e-2, name


@pytest.mark.parametrize("gate_kernel", ["fused", "torch"])
def test_core_bwd_in_half_precision_gives_zero_query_and_key_grads_where_each_softmax_has_one_key(gate_kernel):
    """At T = 1 every branch's softmax has one key (or none), so dQ and dK are exactly zero: dS = P (dP - delta)
    cancels only if delta is summed from the same 16-bit values that the attention backward's dP reads: the stored
    d o_i ("torch" gates), or do itself, each gate folded into its branch's lse ("fused"). (Taking delta as
    g_i * rowsum(do * o_i) in fp32 against dP from the rounded g_i * do left dQ at 1.9% of the reference's scale in
    bf16 on the H100.) fp16 here: the interpreter has no bf16 arithmetic, and fp16 rounds the same way, only finer."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    inputs = make_inputs(2, 1, 4, 2, 16, 16, cfg, seed=23, dtype=torch.float16)
    tri_in = {n: x.to(DEVICE).requires_grad_() for n, x in inputs.items()}
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(gate_kernel=gate_kernel)):
        o = triton_impl.nsa_attention(*tri_in.values(), cfg, scale=16 ** -0.5)
        o.backward(torch.randn_like(o))
    dv_size = tri_in["v_win"].grad.float().abs().max().item()
    assert dv_size > 0.1
    for name in ("q", "k_slc", "k_win"):
        assert tri_in[name].grad.float().abs().max().item() <= 1e-5 * dv_size, name


def check_range_branches(x: dict, cfg: NSAConfig, scale: float, launch, grad_seed: int) -> None:
    """The compressed and window branches under `launch` against the reference: output, lse (-inf in both where
    a query sees no compressed token yet) and the gradients of q, k and v."""
    for branch, (kn, vn) in {"cmp": ("k_cmp", "v_cmp"), "win": ("k_win", "v_win")}.items():
        ref_in = [x[n].clone().requires_grad_() for n in ("q", kn, vn)]
        tri_in = [x[n].float().to(DEVICE).requires_grad_() for n in ("q", kn, vn)]
        with triton_impl.use_launch_config(launch):
            if branch == "cmp":
                o_ref, lse_ref = reference.compressed_attention(*ref_in, cfg, scale)
                o, lse = triton_impl.compressed_attention(*tri_in, cfg, scale)
                seen = cfg.cmp_block - 1
                assert torch.isinf(lse[:, :seen]).all() and rel_err(lse[:, seen:], lse_ref[:, seen:]) <= FP32_TOL
            else:
                o_ref = reference.window_attention(*ref_in, cfg.window, scale)
                o = triton_impl.window_attention(*tri_in, cfg.window, scale)
            grad_out = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(grad_seed),
                                   dtype=torch.float64)
            o_ref.backward(grad_out)
            o.backward(grad_out.float().to(DEVICE))
        assert rel_err(o, o_ref) <= FP32_TOL, branch
        for name, a, r in zip(("dq", "dk", "dv"), tri_in, ref_in):
            assert rel_err(a.grad, r.grad) <= FP32_TOL, (branch, name)


SQUARE_16 = {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16)}
MIXED_TILES = {"fwd": (32, 16), "dq": (16, 32), "dkdv": (32, 16)}  # each kernel its own tiles, none square


@pytest.mark.parametrize("range_kernel,delta_kernel,dkdv_programs,window_dkdv,tiles,q_chunk,loop_heads,H", [
    ("masked", "torch", 1, "group", SQUARE_16, 0, 1, 2), ("split", "fused", 1, "head", MIXED_TILES, 0, 16, 2),
    ("split", "fused", 2048, "group", SQUARE_16, 0, 1, 2),
    ("split", "fused", 2048, "group", MIXED_TILES, 0, 1, 2),
    ("split", "fused", 1, "group", MIXED_TILES, 48, 1, 2),
    ("split", "fused", 1, "group", MIXED_TILES, 48, 16, 3), ("masked", "fused", 1, "group", SQUARE_16, 0, 16, 2),
    ("split", "fused", 1, "group", MIXED_TILES, 0, 3, 6)])
def test_range_variants_match_reference(range_kernel, delta_kernel, dkdv_programs, window_dkdv, tiles, q_chunk,
                                        loop_heads, H):
    """Compressed and window branches, output, lse and all three gradients, with 16- and 32-wide tiles so that
    query tiles have full key tiles between their edges (the split kernels' unmasked runs), T not a multiple of a
    tile, a padded head dim, and queries that see no compressed token; the compressed dK/dV in one program per key
    tile and head, split into query chunks counted from each tile's first query (dkdv_programs = 2048), or into
    absolute chunks (q_chunk 48, rounded up to two 32-row tiles: chunks that cut a key tile's queries, start
    before its first query or end before it); the window dK/dV per group or per head; the forward, dQ and dK/dV
    kernels on the same tiles or each on its own; the window's dK/dV per group with each query tile's 2 or 3 heads
    in one loop (range_dkdv_loop_heads_d64 16, the default at these head dims), each head's loops in turn (1), or 6
    heads in two passes of 3."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=40)
    B, T, G, Dk, Dv = 1, 150, 1, 16, 24  # the heads share the group's keys: their dK/dV add up
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=15)
    scale = Dk ** -0.5
    # head dims <= 64 take the _d64 tiles
    launch = triton_impl.LaunchConfig(**{f"range_{k}_d64": (*t, 4, 2) for k, t in tiles.items()},
                                      range_kernel=range_kernel, delta_kernel=delta_kernel,
                                      range_dkdv_programs=dkdv_programs, window_dkdv=window_dkdv,
                                      range_dkdv_q_chunk=q_chunk, range_dkdv_loop_heads_d64=loop_heads)
    check_range_branches(x, cfg, scale, launch, grad_seed=16)


def test_compressed_dkdv_takes_absolute_chunks_past_one_chunk_and_within_the_grid_limit():
    """range_dkdv_q_chunk: the compressed branch's dK/dV walks absolute query chunks (aligned) only where T is
    longer than one chunk, never for the window branch, and not where its grid's second axis
    (B * H head slices) would pass CUDA's 65535; the chunk is rounded up to whole query tiles. Meta tensors: no
    kernel runs."""
    def split(B, T, H, G, window):
        q = torch.empty(B, T, H, 64, device="meta")
        kv = torch.empty(B, T // 16, G, 64, device="meta")
        return triton_impl._range_dkdv_split(q, kv, kv, T, window)

    launch = triton_impl.LaunchConfig(range_dkdv_q_chunk=4000, range_dkdv_d64=(64, 64, 4, 3))
    with triton_impl.use_launch_config(launch):
        assert split(1, 8192, 12, 2, window=8192) == (True, 6, 4032, True)
        assert split(1, 4000, 12, 2, window=4000)[3] is False  # one chunk: the relative chunks
        assert split(1, 8192, 12, 2, window=512)[3] is False  # the window branch
        assert split(5461, 8192, 12, 2, window=8192)[3] is True  # 65,532 head slices
        assert split(5462, 8192, 12, 2, window=8192)[3] is False  # 65,544
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(range_dkdv_q_chunk=0)):
        assert split(1, 8192, 12, 2, window=8192)[3] is False


def test_range_dkdv_loop_heads_is_the_largest_divisor_of_the_programs_heads_within_the_limit():
    """range_dkdv_loop_heads(_d64): a range dK/dV program over `heads` heads loops over that many of them at a time
    (the kernel asserts it divides them), chosen by the larger head dim of q and v. Meta tensors: no kernel runs."""
    def loop(heads, dk, dv):
        return triton_impl._loop_heads(torch.empty(1, 1, 1, dk, device="meta"),
                                       torch.empty(1, 1, 1, dv, device="meta"), heads)

    with triton_impl.use_launch_config(triton_impl.LaunchConfig(range_dkdv_loop_heads=4,
                                                                range_dkdv_loop_heads_d64=16)):
        assert [loop(h, 64, 64) for h in (1, 6, 16)] == [1, 6, 16]
        assert [loop(h, 128, 128) for h in (1, 6, 16, 3)] == [1, 3, 4, 3]
        assert loop(16, 64, 128) == 4  # Dv past 64
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(range_dkdv_loop_heads_d64=5)):
        assert [loop(h, 64, 64) for h in (6, 10, 7)] == [3, 5, 1]
        assert loop(16, 128, 128) == 4  # the default past head dim 64


@pytest.mark.parametrize("range_kernel,Dv,expect_tma", [("split", 16, True), ("masked", 32, True),
                                                        ("split", 24, False)])
def test_range_kernels_read_tiles_through_descriptors_where_the_layout_allows(range_kernel, Dv, expect_tma,
                                                                              monkeypatch):
    """range_loads = "tma": the compressed and window kernels read q, do, k and v through tensor descriptors, which
    load whole tiles unmasked: the rows past a sequence's end are the next sequence's (batch 2, T not a multiple
    of a tile) and only the score and store masks keep them out. Two groups, so a head's columns start at
    g * D. A head dim of 24 (a padded tile) takes the pointer loads instead; either way the result is the
    reference's. The spy checks which loads ran."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=40)
    B, T, H, G, Dk = 2, 150, 4, 2, 16
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=31)
    scale = Dk ** -0.5
    launch = triton_impl.LaunchConfig(range_loads="tma", range_kernel=range_kernel,
                                      **{f"range_{k}_d64": (32, 16, 4, 2) for k in ("fwd", "dq", "dkdv")})
    seen = []
    real_tiles = triton_impl._tile_args

    def spy(*args, **kwargs):
        out = real_tiles(*args, **kwargs)
        seen.append(out["TMA"])
        return out

    monkeypatch.setattr(triton_impl, "_tile_args", spy)
    check_range_branches(x, cfg, scale, launch, grad_seed=32)
    assert len(seen) == 6 and set(seen) == {expect_tma}  # forward, dQ and dK/dV of each branch


@pytest.mark.parametrize("H,G,range_heads,Dv,expect", [(8, 2, 4, 16, (4, True)), (12, 2, 16, 24, (2, False)),
                                                       (16, 1, 16, 16, (16, True)), (8, 2, 1, 16, (1, True))])
def test_range_tiles_pack_the_heads_of_a_group(H, G, range_heads, Dv, expect, monkeypatch):
    """range_heads: the forward and dQ tiles hold several heads of a group as rows (4 heads of 4 through a 3-D
    descriptor; 2 of 6 heads, the largest power of two that divides them, through pointer loads at a padded head
    dim; all 16 heads of one group, 16-row tiles of a single query each; one head a tile, as before v60), batch 2
    and T = 70 not a multiple of a tile, so the last tiles hold rows past the end. The compressed and window
    branches against the reference; the spy checks what each launch took."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=40)
    B, T, Dk = 2, 70, 16
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=33)
    tiles = {"fwd": (32, 16), "dq": (16, 16), "dkdv": (32, 16)}
    launch = triton_impl.LaunchConfig(range_heads=range_heads,
                                      **{f"range_{k}_d64": (*t, 4, 2) for k, t in tiles.items()})
    seen = []
    real_tiles = triton_impl._tile_args

    def spy(launch, queries, keys, heads=1):
        out = real_tiles(launch, queries, keys, heads)
        seen.append((heads, out["TMA"]))
        return out

    monkeypatch.setattr(triton_impl, "_tile_args", spy)
    check_range_branches(x, cfg, Dk ** -0.5, launch, grad_seed=34)
    heads, tma = expect
    assert len(seen) == 6 and set(seen) == {(heads, tma), (1, tma)}  # forward and dQ packed, dK/dV not
    assert seen.count((heads, tma)) == (6 if heads == 1 else 4)


def test_range_heads_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="range_heads: must be a power of two, got 6"):
        triton_impl.LaunchConfig(range_heads=6)


# the second: more segments (1200) than block_work_kernel (the sort build's) takes per step (1024); the count
# build's tiles there (256 queries of 4 slots) leave T = 150 one partial tile. The third: the count build's 3 tiles
# of 64 queries and 300 blocks, summed 64 blocks a step (_OFFSET_CELLS = 256 cells of 4 tiles), in 5 steps.
@pytest.mark.parametrize("build", ("count", "sort"))
@pytest.mark.parametrize("B, T, G, n, num_blocks, chunk", [(2, 23, 3, 4, 6, 5), (2, 150, 2, 3, 300, 4),
                                                           (2, 150, 2, 16, 300, 4)])
def test_block_work_covers_every_choice_once(B, T, G, n, num_blocks, chunk, build, monkeypatch):
    """The by_block index: every valid slot appears once, in its (b, g, block) segment, in query order; the work
    list hands each segment's entries to programs in chunks, each entry to exactly one program, spares marked -1.
    Random choices, repeats within a query included (the count build sorts each tile by (block, slot))."""
    monkeypatch.setattr(triton_impl, "_OFFSET_CELLS", 256)
    gen = torch.Generator().manual_seed(17)
    blocks = torch.randint(-1, num_blocks, (B, T, G, n), generator=gen, dtype=torch.int32)
    index = triton_impl.block_work(blocks.to(DEVICE), num_blocks, chunk, build=build)
    order, starts, work_seg, work_chunk = (x.cpu() for x in index)
    valid = int((blocks >= 0).sum())
    assert int(starts[-1]) == valid
    assert order.dtype == starts.dtype == work_seg.dtype == work_chunk.dtype == torch.int32  # no cast launches
    flat = blocks.flatten().long()
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for seg in range(B * G * num_blocks):
        b, g, j = seg // (G * num_blocks), (seg // num_blocks) % G, seg % num_blocks
        entries = order[int(starts[seg]):int(starts[seg + 1])].long()
        assert (flat[entries] == j).all()
        t = (entries // (G * n)) % T
        assert ((entries // (T * G * n)) == b).all() and (((entries // n) % G) == g).all()
        assert (t[1:] >= t[:-1]).all()
        covered = sorted(int(c) for s, c in zip(work_seg.tolist(), work_chunk.tolist()) if s == seg)
        assert covered == list(range(max(1, -(-entries.numel() // chunk))))  # an empty segment: one item too
        seen[entries] += 1
    assert torch.equal(seen, (flat >= 0).long())
    assert (work_seg >= -1).all() and int((work_seg >= 0).sum()) == sum(
        max(1, -(-int(starts[s + 1] - starts[s]) // chunk)) for s in range(B * G * num_blocks))
    if build == "count":  # the unused entries are set, not left as whatever memory held (opcheck's reruns)
        assert (order[valid:] == -1).all()
    fake = triton_impl.block_work(blocks.to(DEVICE), num_blocks, chunk, shapes_only=True, build=build)
    assert [x.shape for x in fake] == [x.shape for x in index]  # nsa::core's fake gives the real shapes


def test_block_work_builds_agree():
    """Both builds give the same order of the valid slots and the same segment starts, with the selections a
    real selection gives (distinct blocks a query, at most the blocks a query can see, the rest -1)."""
    gen = torch.Generator().manual_seed(3)
    B, T, G, n, sel_block = 2, 200, 2, 5, 8
    num_blocks = -(-T // sel_block)
    keys = torch.rand(B, T, G, num_blocks, generator=gen)
    visible = torch.arange(num_blocks)[None, None, None, :] <= (torch.arange(T) // sel_block)[None, :, None, None]
    top = torch.where(visible, keys, -1.0).topk(n, dim=-1)
    blocks = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
    count = triton_impl.block_work(blocks.to(DEVICE), num_blocks, 16, build="count")
    sort = triton_impl.block_work(blocks.to(DEVICE), num_blocks, 16, build="sort")
    valid = int((blocks >= 0).sum())
    assert torch.equal(count[1].cpu(), sort[1].cpu()) and int(count[1][-1]) == valid
    assert torch.equal(count[0][:valid].cpu(), sort[0][:valid].cpu())


# 125M: 16 x 2k and 4 x 8k count, 32k sorts; paper 8k counts, 64k sorts; a short T with n = 3 (tiles of 256)
@pytest.mark.parametrize("T, n, num_blocks, expect", [(2048, 16, 32, "count"), (8192, 16, 128, "count"),
                                                      (32768, 16, 512, "sort"), (65536, 16, 1024, "sort"),
                                                      (150, 3, 300, "count"), (8192, 16, 129, "sort")])
def test_auto_index_build_counts_up_to_its_cells(T, n, num_blocks, expect):
    assert triton_impl.index_build(T, n, num_blocks, "auto") == expect
    assert triton_impl.index_build(T, n, num_blocks, "sort") == "sort"


def test_block_work_refuses_an_unknown_build():
    with pytest.raises(ValueError, match="build must be one of"):
        triton_impl.block_work(torch.zeros(1, 4, 1, 2, dtype=torch.int32, device=DEVICE), 2, 4, build="radix")


@pytest.mark.parametrize("num_blocks, key_dtype", [(4, torch.int16), (5461, torch.int16), (5462, torch.int32)])
def test_segment_sort_uses_the_narrowest_keys_that_hold_every_segment(num_blocks, key_dtype):
    """B*G*num_blocks = 6 * num_blocks segments plus the empty-slot id: 32766 still fits int16, 32772 does not.
    The narrow keys must give exactly the int64 stable sort's order and segment boundaries."""
    gen = torch.Generator().manual_seed(5)
    B, T, G, n = 2, 37, 3, 4
    blocks = torch.randint(-1, num_blocks, (B, T, G, n), generator=gen, dtype=torch.int32)
    blocks[0, 0, 0] = num_blocks - 1  # the largest segment id is present
    sorted_segment, order = (x.cpu() for x in triton_impl._sorted_segments(blocks.to(DEVICE), num_blocks))
    group = torch.arange(B).view(B, 1, 1, 1) * G + torch.arange(G).view(1, 1, G, 1)
    wide = torch.where(blocks >= 0, group * num_blocks + blocks.long(), B * G * num_blocks).flatten()
    wide_sorted, wide_order = torch.sort(wide, stable=True)
    assert sorted_segment.dtype == key_dtype
    assert torch.equal(order, wide_order) and torch.equal(sorted_segment.long(), wide_sorted)


# up to _UNION_KERNEL_WIDTHS (16) times a tile's tile_q * 4 slots in blocks, the kernel; more, the sorts. tile_q = 5:
# the kernel reads 8 queries per step; 40 and 500 blocks over 8 x 4 slots: the kernel past the width (500: 4 x 512
# block ids a step, two steps); 600: the sorts
@pytest.mark.parametrize("num_blocks, tile_q", [(9, 8), (9, 5), (40, 8), (500, 8), (600, 8)])
def test_tile_block_union(num_blocks, tile_q, monkeypatch):
    """Each tile's union is its queries' distinct valid blocks, ascending, counted, padded after the count."""
    gen = torch.Generator().manual_seed(13)
    blocks = torch.randint(-1, 9, (2, 21, 3, 4), generator=gen, dtype=torch.int32)
    seen = []
    real = {name: getattr(triton_impl, name) for name in ("_union_by_kernel", "_union_by_sort")}
    for name, fn in real.items():
        monkeypatch.setattr(triton_impl, name, lambda *a, fn=fn, name=name: seen.append(name) or fn(*a))
    union, count, members = (x.cpu() for x in triton_impl.tile_block_union(blocks.to(DEVICE), tile_q, num_blocks))
    assert seen == ["_union_by_kernel" if num_blocks <= 16 * tile_q * 4 else "_union_by_sort"]
    tiles = -(-21 // tile_q)
    assert union.shape == (2, tiles, 3, tile_q * 4) and count.shape == (2, tiles, 3)
    assert members.shape == union.shape and members.dtype == torch.int64
    for b in range(2):
        for tile in range(tiles):
            for g in range(3):
                queries = blocks[b, tile * tile_q:(tile + 1) * tile_q, g]  # [<= tile_q, 4]; duplicates possible
                chosen = queries.flatten()
                expected = torch.unique(chosen[chosen >= 0])  # sorted
                c = int(count[b, tile, g])
                assert c == expected.numel()
                assert torch.equal(union[b, tile, g, :c].long(), expected.long())
                # bit q of an entry's mask: the tile's query q chose that block
                masks = [sum(1 << q for q in range(queries.shape[0]) if int(block) in queries[q].tolist())
                         for block in expected]
                assert members[b, tile, g, :c].tolist() == masks


def test_tile_block_union_refuses_tiles_past_its_masks():
    """A tile's membership masks are int64: a tile of more than 64 queries is refused, naming the setting."""
    blocks = torch.zeros(1, 130, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a tile of 65 queries; its membership masks hold 64 .*slc_tile_rows"):
        triton_impl.tile_block_union(blocks.to(DEVICE), 65, 4)
    union, count, members = triton_impl.tile_block_union(blocks.to(DEVICE), 64, 4)  # 64 fit: bit 63 is query 63
    assert count.flatten().tolist() == [1, 1, 1] and members[0, 0, 0, 0].item() == -1  # all 64 bits set


@pytest.mark.parametrize("form", ["kernel", "sort"])
def test_tile_union_forms_on_full_unions(form):
    """Full unions (as many distinct blocks as slots) among more blocks than slots: no unchosen block lands in a
    slot, in either form; the kernel pads after the count."""
    per_tile = torch.tensor([[5, 9, 14, 2], [0, 1, 1, -1]], dtype=torch.int32)  # [tiles, slots]: one query each
    if form == "kernel":
        union, count, members = triton_impl._union_by_kernel(per_tile.view(1, 2, 1, 4).to(DEVICE), 1, 16)
        union, count, members = union.view(2, 4).cpu(), count.view(2).cpu(), members.view(2, 4).cpu()
        assert union[1, 2:].tolist() == [torch.iinfo(torch.int32).max] * 2
    else:
        union, count, members = triton_impl._union_by_sort(per_tile, 4)
    assert count.tolist() == [4, 2]
    assert union[0].tolist() == [2, 5, 9, 14] and union[1, :2].tolist() == [0, 1]
    assert members[0].tolist() == [1] * 4 and members[1, :2].tolist() == [1, 1]  # the tile's one query chose each


def test_fused_gated_sum_matches_torch():
    """The fused gate kernels (forward; backward to the gates and all three branch outputs) against autograd of
    the eager formula, with a head dim that is not a power of two and rows that do not fill the last program."""
    gen = torch.Generator().manual_seed(14)
    B, T, H, Dv = 2, 7, 3, 24
    outs = [torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64) for _ in range(3)]
    gates = torch.rand(B, T, H, 3, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (gates, *outs)]
    o_ref = ref_in[0][..., 0:1] * ref_in[1] + ref_in[0][..., 1:2] * ref_in[2] + ref_in[0][..., 2:3] * ref_in[3]
    o_ref.backward(grad_out)
    tri_in = [x.float().to(DEVICE).requires_grad_() for x in (gates, *outs)]
    with triton_impl.use_launch_config(triton_impl.LaunchConfig(gate_kernel="fused")):
        o = triton_impl.gated_sum(*tri_in)
    o.backward(grad_out.float().to(DEVICE))
    assert rel_err(o, o_ref) <= FP32_TOL
    for name, a, r in zip(("gates", "o_cmp", "o_slc", "o_win"), tri_in, ref_in):
        assert rel_err(a.grad, r.grad) <= FP32_TOL, name


@pytest.mark.parametrize("attention_recompute", [False, True])
def test_compiled_model_with_the_triton_core_is_one_graph_and_matches_eager(attention_recompute, monkeypatch):
    """The Triton core is one custom op (nsa::core, with nsa::core_bwd): torch.compile traces a whole NSA model,
    core included, with fullgraph=True (no graph break anywhere: one graph per forward, the head and its fp32
    logits compiled too), and the compiled model's loss and gradients are the eager model's. With
    attention_recompute too (selective checkpointing inside the compiled graph)."""
    from nsa_model import ModelConfig, Transformer

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets backend="triton" take CPU tensors (kernels: interpreted)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    torch.manual_seed(0)
    model = Transformer(cfg, backend="triton", attention_recompute=attention_recompute).to(DEVICE)
    x = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)  # B = 1: CI time
    explained = torch._dynamo.explain(model)(x[:, :-1], x[:, 1:])
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    # with attention_recompute the cores sit in the checkpointed regions' subgraphs
    core_calls = [n for m in explained.graphs[0].modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.target in (torch.ops.nsa.core, torch.ops.nsa.core.default)]
    assert len(core_calls) == cfg.n_layers
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    _, loss_c = torch.compile(model, backend="aot_eager", fullgraph=True)(x[:, :-1], x[:, 1:])
    loss_c.backward()
    assert torch.allclose(loss_c, loss, rtol=1e-5)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.allclose(p.grad, eager[n], rtol=1e-4, atol=1e-6), n


def test_compile_model_runs_every_swept_nsa_setting_on_one_traced_graph(monkeypatch):
    """compile_model traces l' and n as symbolic ints: models at three settings run on one forward and one backward
    graph, traced once (no recompilation: the same graph inductor's FX graph cache keys on, so a sweep's next
    trial on a node finds what the trial before it compiled; kernels-notes.md v74), and each gets its own eager
    model's loss and gradients from it. At T = 32 the setting l' = 4, n = 3 runs by_block and the other two
    tiled_by_block: the variant is chosen inside nsa::core_bwd, not a constant of the backward graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from nsa_model import Transformer, compile_model

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.compiler.config, "dynamic_sources", "")  # this process's setting, restored after
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    base = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6)
    x = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch._dynamo.reset()
    losses = []
    for nsa in (base, dataclasses.replace(base, n_selected=5), dataclasses.replace(base, sel_block=8)):
        cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                          attention="nsa", nsa=nsa)
        torch.manual_seed(0)
        model = Transformer(cfg, backend="triton").to(DEVICE)
        _, loss = compile_model(model, backend=backend, fullgraph=True)(x[:, :-1], x[:, 1:])
        loss.backward()
        compiled = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        _, eager = model(x[:, :-1], x[:, 1:])
        eager.backward()
        assert len(graphs) == 2, (nsa, len(graphs))  # the first setting's forward and backward, and no others
        assert torch.allclose(loss, eager, rtol=1e-6), nsa
        for name, p in model.named_parameters():
            assert torch.allclose(compiled[name], p.grad, rtol=1e-5, atol=1e-7), (nsa, name)
        losses.append(eager.item())
    assert len(set(losses)) == 3  # three different models


def test_compile_model_makes_the_setting_symbolic_only_for_the_triton_core(monkeypatch):
    """compile_model adds its sources to dynamo's once, for a model whose NSA runs the Triton core; a model on the
    torch backend (the setting shapes its graph's own kernels) or with no NSA leaves them as they were."""
    from nsa_model import Transformer
    from nsa_model.model import SWEPT_SETTING_SOURCES, compile_model

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    monkeypatch.setattr(torch.compiler.config, "dynamic_sources", "L['x']")
    compile_model(Transformer(cfg, backend="torch"))
    compile_model(Transformer(cfg.replace(attention="dense")).to(DEVICE))
    compile_model(torch.nn.Linear(2, 2))
    assert torch.compiler.config.dynamic_sources == "L['x']"
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_model = Transformer(cfg, backend="triton").to(DEVICE)
    compile_model(triton_model)
    compile_model(triton_model)
    assert torch.compiler.config.dynamic_sources == f"L['x'],{SWEPT_SETTING_SOURCES}"


def test_compile_model_pins_tritons_cache_folder_where_unset(monkeypatch, tmp_path):
    """compile_model sets TRITON_CACHE_DIR to the folder Triton would use, so that inductor, which sets it where
    unset, cannot move the NSA kernels' cache in the middle of a run; a folder the user set stays."""
    import triton

    from nsa_model.model import compile_model

    monkeypatch.setenv("TRITON_CACHE_DIR", "restored after the test")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    default = triton.knobs.cache.dir  # ~/.triton/cache
    compile_model(torch.nn.Linear(2, 2))
    assert os.environ["TRITON_CACHE_DIR"] == default
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    compile_model(torch.nn.Linear(2, 2))
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("attention_recompute", [False, True])
def test_attention_recompute_runs_the_projection_again_and_the_core_once(attention_recompute, monkeypatch):
    """attention_recompute keeps nsa::core's results and recomputes the rest of the attention module: the core's
    forward runs once per layer and step, the q/k/v split and RoPE (nsa::rope_split) twice, eagerly and in the
    graphs torch.compile builds (no core in the backward graph, one rope_split per layer there). The results are
    the same either way (test_compiled_model_with_the_triton_core_is_one_graph_and_matches_eager)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from nsa_model import ModelConfig, Transformer

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    torch.manual_seed(0)
    model = Transformer(cfg, backend="triton", attention_recompute=attention_recompute).to(DEVICE)
    x = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)  # B = 1: CI time
    runs = {"core": 0, "rope_split": 0}
    select_blocks, rope_launch = triton_impl.select_blocks, triton_impl._rope_launch

    def count(name, fn, when=lambda *a, **k: True):
        def counted(*args, **kwargs):
            runs[name] += when(*args, **kwargs)
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(triton_impl, "select_blocks", count("core", select_blocks))  # once a core forward
    monkeypatch.setattr(triton_impl, "_rope_launch", count("rope_split", rope_launch,
                                                           lambda *a, inverse: not inverse))
    model(x[:, :-1], x[:, 1:])[1].backward()
    assert runs == {"core": cfg.n_layers, "rope_split": cfg.n_layers * (2 if attention_recompute else 1)}

    graphs = {}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compile_graph

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch.compile(model, backend=backend, fullgraph=True)(x[:, :-1], x[:, 1:])[1].backward()
    calls = {kind: {op: sum(t in (op, op.default) for t in targets)
                    for op in (torch.ops.nsa.core, torch.ops.nsa.rope_split)} for kind, targets in graphs.items()}
    assert calls["forward"] == {torch.ops.nsa.core: cfg.n_layers, torch.ops.nsa.rope_split: cfg.n_layers}
    assert calls["backward"] == {torch.ops.nsa.core: 0,
                                 torch.ops.nsa.rope_split: cfg.n_layers if attention_recompute else 0}


def _may_overlap_itself(x: torch.Tensor) -> bool:
    """The layout test torch <= 2.12 applies to a compiled graph's inputs before it CUDA-graphs the graph: sorted
    by stride (size-1 and broadcast dims aside), each dim's stride must reach past the extent of the dims before
    it. A graph with an input that fails it runs without CUDA graphs ("complex memory overlap")."""
    dims = sorted((x.stride(i), x.size(i)) for i in range(x.dim()) if x.size(i) > 1 and x.stride(i) > 0)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def test_compiled_nsa_step_gives_cuda_graphs_no_self_overlapping_input(monkeypatch):
    """compile_mode reduce-overhead replays each compiled graph as a CUDA graph, and torch <= 2.12 (the GPU hosts
    run 2.11) skips a graph one of whose inputs overlaps itself. phi's unfold view (compressed tokens l = 2d wide,
    d apart) is such a tensor: saved for the backward by phi's checkpoint, it once sent NSA's whole backward
    outside the graphs. No input of the forward or the backward graph may be one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from nsa_model import ModelConfig, Transformer

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    overlapping = {}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            overlapping[kind] = [name for name, x in zip(names, example_inputs)
                                 if isinstance(x, torch.Tensor) and _may_overlap_itself(x)]
            return make_boxed_func(gm.forward)
        return compile_graph

    torch.manual_seed(0)
    model = Transformer(cfg, backend="triton").to(DEVICE)
    x = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    _, loss = torch.compile(model, backend=backend, fullgraph=True)(x[:, :-1], x[:, 1:])
    loss.backward()
    assert overlapping == {"forward": [], "backward": []}
    assert _may_overlap_itself(torch.zeros(2, 9, 3).unfold(1, 4, 2))  # the check itself sees an unfold's windows


@pytest.mark.parametrize("recompute", [False, True])
def test_core_op_passes_torch_library_opcheck(recompute, monkeypatch):
    """torch.library.opcheck: nsa::core's schema, fake (shape) implementation, autograd registration and
    aot_dispatch agree with what the op really does, with and without recompute."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6)
    x = make_inputs(1, 13, 4, 2, 8, 8, cfg, seed=3, dtype=torch.float32)
    args = [t.to(DEVICE).requires_grad_(True) for t in x.values()]
    args += [cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window, cfg.n_init_blocks,
             cfg.n_local_blocks, 0.3, recompute]
    torch.library.opcheck(torch.ops.nsa.core.default, args)


def test_core_with_recompute_keeps_no_range_outputs_and_gives_the_same_results():
    """recompute: nsa::core returns empty o_cmp and o_win (nothing of theirs is kept for the backward) and its
    backward runs their forward kernels again, on the same inputs: output and all eight gradients are those of the
    core that keeps them, bit for bit (on a GPU, up to the order of the dK/dV kernels' atomic adds), and both
    match the float64 reference."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    B, T, H, G, Dk, Dv = 1, 29, 6, 2, 16, 32
    inputs = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=22)
    scale = Dk ** -0.5
    o_ref, ref_in, grad_out = reference_with_grads(inputs, cfg, scale)
    results = {}
    for recompute in (False, True):
        tri_in = {n: x.float().to(DEVICE).requires_grad_() for n, x in inputs.items()}
        outs = torch.ops.nsa.core(*tri_in.values(), cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected,
                                  cfg.window, cfg.n_init_blocks, cfg.n_local_blocks, scale, recompute)
        o_cmp, o_win = outs[2], outs[6]
        assert (o_cmp.numel() == 0 and o_win.numel() == 0) == recompute
        outs[0].backward(grad_out.float().to(DEVICE))
        results[recompute] = [outs[0]] + [tri_in[n].grad for n in NAMES]
    for name, kept, recomputed, ref in zip(("o",) + NAMES, results[False], results[True],
                                           [o_ref] + [ref_in[n].grad for n in NAMES]):
        if ON_GPU and name != "o":
            assert rel_err(recomputed, kept) <= 1e-6, name
        else:
            assert torch.equal(kept, recomputed), name
        assert rel_err(recomputed, ref) <= FP32_TOL, name


def test_only_the_core_ops_output_carries_a_gradient():
    """nsa::core returns o and, for its backward, the selections and branch outputs: only o may require grad, so
    that no backward (eager or AOTAutograd's) fills zero gradients for the other eleven, three [B, T, H, Dv]
    tensors among them."""
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6)
    x = make_inputs(1, 13, 4, 2, 8, 8, cfg, seed=3, dtype=torch.float32)
    args = [t.to(DEVICE).requires_grad_(True) for t in x.values()]
    outs = torch.ops.nsa.core(*args, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window,
                              cfg.n_init_blocks, cfg.n_local_blocks, 0.3, False)
    assert outs[0].requires_grad
    assert [i for i, t in enumerate(outs) if t.requires_grad] == [0]
    outs[0].sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in args)


ROPE_PARTS = dict(heads=[3, 1, 1, 1, 1, 1, 1], head_dims=[16, 16, 16, 16, 8, 8, 8],
                  rotate=[True, True, True, True, False, False, False])  # q, three K sets, three V sets (Dk != Dv)


def _rope_split_by_torch(y, rope, parts):
    from nsa_model.attention import rotate_and_split
    return rotate_and_split(y, rope, parts["heads"], parts["head_dims"], parts["rotate"], backend="torch")


@pytest.mark.parametrize("transposed_grads", [False, True])
def test_rope_split_matches_the_torch_rotation_and_its_gradient(transposed_grads):
    """nsa::rope_split (one Triton launch each way) against RotaryEmbedding and plain slicing: the same
    parts and the same gradient of y, also when the parts' gradients come with their heads outermost (dense
    attention's SDPA gives [B, H, T, D] gradients, transposed views here)."""
    from nsa_model.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, max_seq_len=40, theta=10000.0).to(DEVICE)
    gen = torch.Generator().manual_seed(31)
    y = torch.randn(2, 37, 3 * 16 + 3 * 16 + 3 * 8, generator=gen).to(DEVICE)
    grads = []
    for h, d in zip(ROPE_PARTS["heads"], ROPE_PARTS["head_dims"]):
        g = torch.randn(2, h, 37, d, generator=gen).to(DEVICE)
        grads.append(g.transpose(1, 2) if transposed_grads else g.transpose(1, 2).contiguous())
    results = []
    for split in (_rope_split_by_torch, lambda y, rope, p: triton_impl.rope_split(y, rope.cos, rope.sin, **p)):
        y_in = y.clone().requires_grad_()
        parts = split(y_in, rope, ROPE_PARTS)
        torch.autograd.backward(parts, grads)
        results.append((parts, y_in.grad))
    (ref_parts, ref_grad), (parts, grad) = results
    assert [tuple(p.shape) for p in parts] == [tuple(p.shape) for p in ref_parts]
    assert all(p.is_contiguous() and p._base is None for p in parts)
    for p, r in zip(parts, ref_parts):
        assert torch.allclose(p, r, rtol=1e-6, atol=1e-6)
    assert torch.allclose(grad, ref_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_rope_split_at_a_device_position_writes_the_sets_into_their_buffers(T):
    """A decoding step's split (rope_split_at): y's tokens at positions p .., p read from a device tensor, the
    parts with a buffer written into it at rows p .. (bf16 buffers from fp32 y) and returned as it, the others new
    tensors; against RotaryEmbedding at p and index_copy_. Rows outside p .. keep what they held."""
    from nsa_model.attention import rotate_and_split
    from nsa_model.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, max_seq_len=40, theta=10000.0).to(DEVICE)
    gen = torch.Generator().manual_seed(32)
    y = torch.randn(2, T, 3 * 16 + 3 * 16 + 3 * 8, generator=gen).to(DEVICE)
    p = 29
    heads, dims = ROPE_PARTS["heads"], ROPE_PARTS["head_dims"]
    into = [None] + [torch.randn(2, 40, h, d, generator=gen).to(torch.bfloat16).to(DEVICE)
                     for h, d in zip(heads[1:], dims[1:])]
    before = [b.clone() if b is not None else None for b in into]
    expected = rotate_and_split(y, rope, heads, dims, ROPE_PARTS["rotate"], "torch", p)
    parts = triton_impl.rope_split_at(y, rope.cos, rope.sin, heads, dims, ROPE_PARTS["rotate"],
                                      torch.tensor([p], device=DEVICE), into)
    assert parts[0].shape == (2, T, 3, 16) and torch.allclose(parts[0], expected[0], rtol=1e-6, atol=1e-6)
    for part, buffer, old, ref in zip(parts[1:], into[1:], before[1:], expected[1:]):
        assert part is buffer
        # bf16 within one ulp: the interpreter truncates where the GPU rounds
        assert torch.allclose(buffer[:, p:p + T].float(), ref, rtol=2 ** -7, atol=1e-6)
        assert torch.equal(buffer[:, :p], old[:, :p]) and torch.equal(buffer[:, p + T:], old[:, p + T:])
    with pytest.raises(ValueError, match=r"into\[1\]: expected a buffer \[2, L, 1, 16\]"):
        triton_impl.rope_split_at(y, rope.cos, rope.sin, heads, dims, ROPE_PARTS["rotate"],
                                  torch.tensor([p], device=DEVICE), [None, into[2].transpose(2, 3)] + into[2:])
    with pytest.raises(ValueError, match="position: expected one int64"):
        triton_impl.rope_split_at(y, rope.cos, rope.sin, heads, dims, ROPE_PARTS["rotate"],
                                  torch.tensor([p, p], device=DEVICE), into)


def test_rope_split_passes_torch_library_opcheck():
    from nsa_model.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, max_seq_len=16, theta=100.0).to(DEVICE)
    y = torch.randn(1, 11, 3 * 16 + 3 * 16 + 3 * 8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch.library.opcheck(torch.ops.nsa.rope_split.default,
                          [y.requires_grad_(), rope.cos, rope.sin, *ROPE_PARTS.values()])


def test_attention_stat_sums_passes_torch_library_opcheck():
    gen = torch.Generator().manual_seed(6)
    blocks = torch.randint(-1, 3, (2, 9, 2, 3), generator=gen, dtype=torch.int32).to(DEVICE)
    torch.library.opcheck(torch.ops.nsa.attention_stat_sums.default,
                          [blocks, torch.rand(2, 9, 4, 3, generator=gen).to(DEVICE), 4])


@pytest.mark.parametrize("bad, match", [(dict(heads=[3, 1]), "must tile y's width"),
                                        (dict(table_rows=5), "cos: expected a contiguous float32"),
                                        (dict(strided=True), "contiguous columns")])
def test_rope_split_refuses_parts_and_tables_that_do_not_fit(bad, match):
    y = torch.zeros(1, 7, 3 * 16 + 3 * 16 + 3 * 8, device=DEVICE)
    if bad.get("strided"):
        y = torch.zeros(1, 7, 120 * 2, device=DEVICE)[..., ::2]
    table = torch.zeros(bad.get("table_rows", 8), 8, device=DEVICE)
    parts = {**ROPE_PARTS, **{k: v for k, v in bad.items() if k in ROPE_PARTS}}
    with pytest.raises(ValueError, match=match):
        triton_impl.rope_split(y, table, table, **parts)


def _phi_by_torch(x, w1, b1, w2, b2, block, stride):
    import torch.nn.functional as F
    blocks = x.unfold(1, block, stride).transpose(-1, -2).flatten(-2)  # [B, Tc, G, l*D], NSA_SPEC's phi
    return F.linear(F.gelu(F.linear(blocks, w1, b1)), w2, b2)


def _phi_leaves(B, T, G, D, hidden, block, seed):
    """x as a strided view (one K/V set inside a stacked [B, T, 2, G, D] tensor) and phi's weights."""
    gen = torch.Generator().manual_seed(seed)
    stacked = torch.randn(B, T, 2, G, D, generator=gen)
    w1 = torch.randn(hidden, block * D, generator=gen) / (block * D) ** 0.5
    w2 = torch.randn(D, hidden, generator=gen) / hidden ** 0.5
    return [t.to(DEVICE) for t in (stacked, w1, torch.randn(hidden, generator=gen), w2, torch.randn(D, generator=gen))]


@pytest.mark.parametrize("block, stride, T, dx_offsets", [(8, 4, 37, 16), (8, 4, 8, 16), (8, 2, 19, 16), (4, 4, 13, 16),
                                                        (16, 8, 40, 16), (8, 8, 21, 16), (16, 8, 40, 2),
                                                        (8, 4, 37, 1)])
def test_phi_mlp_matches_the_torch_formula_and_its_gradients(monkeypatch, block, stride, T, dx_offsets):
    """nsa::phi_mlp (one launch forward, three backward) against unfold, Linear, GELU, Linear: y and the gradients
    of x, both weights and both biases, for T a multiple of d or not and T = l, a hidden width and head dim that
    are not powers of two, and x a strided view (a K/V set inside a stacked tensor): the other set's gradient
    stays zero. The x backward with every offset u in one program (_PHI_DX_OFFSETS, its gcd with d), d / 4, and 1."""
    monkeypatch.setattr(triton_impl, "_PHI_DX_OFFSETS", dx_offsets)
    B, G, D, hidden = 2, 3, 24, 10
    leaves = _phi_leaves(B, T, G, D, hidden, block, seed=block * 100 + T)
    weights = torch.randn(B, (T - block) // stride + 1, G, D, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    results = []
    for phi in (_phi_by_torch, triton_impl.phi_mlp):
        inputs = [t.clone().requires_grad_() for t in leaves]
        y = phi(inputs[0][:, :, 1], *inputs[1:], block, stride)
        (y * weights).sum().backward()
        results.append([y.detach()] + [t.grad for t in inputs])
    for name, want, got in zip(("y", "x", "fc1.weight", "bias", "fc2.weight", "fc2.bias"), *results):
        assert got.shape == want.shape and rel_err(got, want) <= FP32_TOL, name
    assert results[1][1][:, :, 0].abs().max() == 0


@pytest.mark.parametrize("sets", [1, 2])
def test_phi_mlp_passes_torch_library_opcheck(sets):
    leaves = _phi_leaves(1, 13, 2, 16, 16, 8, seed=3)
    x0, x1 = (leaves[0][:, :, i].detach().requires_grad_() for i in (0, 1))
    weights = [torch.stack([t] * sets).requires_grad_() for t in leaves[1:]]
    torch.library.opcheck(torch.ops.nsa.phi_mlp.default, [x0, x1 if sets == 2 else x0, *weights, 8, 4])


@pytest.mark.parametrize("block, stride, T", [(8, 4, 37), (16, 8, 40)])
def test_phi_mlp_pair_is_phi_of_each_set(block, stride, T):
    """phi_mlp_pair (k and v in one launch each way) against the torch formula on each set with its own weights:
    both outputs and the gradients of both inputs and of all eight weights and biases."""
    B, G, D, hidden = 2, 3, 24, 10
    leaves_k = _phi_leaves(B, T, G, D, hidden, block, seed=block * 10 + T)
    leaves_v = _phi_leaves(B, T, G, D, hidden, block, seed=block * 10 + T + 1)
    tc = (T - block) // stride + 1
    gen = torch.Generator().manual_seed(T)
    weights = [torch.randn(B, tc, G, D, generator=gen).to(DEVICE) for _ in range(2)]
    results = []
    for pair in (False, True):
        k_in, v_in = ([t.clone().requires_grad_() for t in leaves] for leaves in (leaves_k, leaves_v))
        x_k, x_v = k_in[0][:, :, 1], v_in[0][:, :, 0]
        if pair:
            stacked = tuple(torch.stack([a, b]) for a, b in zip(k_in[1:], v_in[1:]))
            y_k, y_v = triton_impl.phi_mlp_pair(x_k, x_v, stacked, block, stride)
        else:
            y_k, y_v = _phi_by_torch(x_k, *k_in[1:], block, stride), _phi_by_torch(x_v, *v_in[1:], block, stride)
        ((y_k * weights[0]).sum() + (y_v * weights[1]).sum()).backward()
        results.append([y_k.detach(), y_v.detach()] + [t.grad for t in k_in + v_in])
    for i, (want, got) in enumerate(zip(*results)):
        assert got.shape == want.shape and rel_err(got, want) <= FP32_TOL, i


@pytest.mark.parametrize("bad, match", [(dict(T=7), "at most T=7"), (dict(stride=3), "multiple of the stride"),
                                        (dict(w1_cols=8 * 16 - 1), "fc1.weight"), (dict(strided=True), "contiguous")])
def test_phi_mlp_refuses_shapes_it_does_not_compute(bad, match):
    T, stride = bad.get("T", 13), bad.get("stride", 4)
    x = torch.zeros(1, T, 2, 16 * (2 if bad.get("strided") else 1), device=DEVICE)
    x = x[..., ::2] if bad.get("strided") else x
    w1 = torch.zeros(16, bad.get("w1_cols", 8 * 16), device=DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_impl.phi_mlp(x, w1, torch.zeros(16, device=DEVICE), torch.zeros(16, 16, device=DEVICE),
                            torch.zeros(16, device=DEVICE), 8, stride)


def test_phi_mlp_pair_refuses_sets_it_does_not_compute():
    """Two sets run in one launch only with one shape for both inputs and the weights stacked two deep; the op
    itself takes one or two sets."""
    x = torch.zeros(1, 13, 2, 16, device=DEVICE)
    w = (torch.zeros(16, 8 * 16, device=DEVICE), torch.zeros(16, device=DEVICE), torch.zeros(16, 16, device=DEVICE),
         torch.zeros(16, device=DEVICE))
    pair = tuple(torch.stack([t] * 2) for t in w)
    with pytest.raises(ValueError, match="one shape and dtype"):
        triton_impl.phi_mlp_pair(x, torch.zeros(1, 14, 2, 16, device=DEVICE), pair, 8, 4)
    with pytest.raises(ValueError, match=r"shape \[2, \.\.\.\]"):
        triton_impl.phi_mlp_pair(x, x, tuple(torch.stack([t] * 3) for t in w), 8, 4)
    with pytest.raises(ValueError, match="fc1.weight"):  # each set's weights checked as phi_mlp checks them
        triton_impl.phi_mlp_pair(x, x, (pair[0][:, :, :-1], *pair[1:]), 8, 4)
    with pytest.raises(ValueError, match="one or two sets"):
        torch.ops.nsa.phi_mlp(x, x, *(torch.stack([t] * 3) for t in w), 8, 4)


@pytest.mark.parametrize("phi_kernel", ["fused", "torch"])
def test_compressor_on_the_triton_backend_runs_phi_mlp_unless_told_and_matches_the_torch_path(phi_kernel,
                                                                                              monkeypatch):
    """Compressor (phi = mlp, with its position embedding) on backend triton runs nsa::phi_mlp, or with
    LaunchConfig(phi_kernel="torch") PyTorch's ops; either way output and every gradient are the torch
    backend's."""
    from nsa_model.attention import Compressor

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    nsa = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
    torch.manual_seed(0)
    ref = Compressor("mlp", 16, nsa, hidden=24, backend="torch").to(DEVICE)
    torch.nn.init.normal_(ref.pos_emb)
    phi = Compressor("mlp", 16, nsa, hidden=24, backend="triton").to(DEVICE)
    phi.load_state_dict(ref.state_dict())
    calls = []
    real = triton_impl.phi_mlp
    monkeypatch.setattr(triton_impl, "phi_mlp", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 30, 2, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    with triton_impl.use_launch_config(dataclasses.replace(triton_impl.launch_config(), phi_kernel=phi_kernel)):
        for module in (ref, phi):
            x_in = x.clone().requires_grad_()
            y = module(x_in)
            grads.append([y] + list(torch.autograd.grad(y.square().sum(), [x_in, *module.parameters()])))
    assert len(calls) == (phi_kernel == "fused")
    for want, got in zip(*grads):
        assert rel_err(got, want) <= FP32_TOL


@pytest.mark.parametrize("v_head_dim, pairs", [(0, 1), (12, 0)])
def test_nsa_attention_runs_phi_k_and_phi_v_as_one_pair_where_their_shapes_match(v_head_dim, pairs, monkeypatch):
    """On backend triton NSAAttention compresses its keys and values in one nsa::phi_mlp of two sets where
    Dk = Dv (each module alone where they differ, here Dv = 12 against Dk = 8): output and every parameter
    gradient are those of the same layer running phi_k and phi_v apart."""
    from nsa_model.attention import Compressor, NSAAttention

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      phi="mlp", v_head_dim=v_head_dim or None,
                      nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    calls = []
    real = triton_impl.phi_mlp_pair
    monkeypatch.setattr(triton_impl, "phi_mlp_pair", lambda *a: calls.append(1) or real(*a))
    results = []
    for apart in (False, True):
        if apart:
            monkeypatch.setattr(Compressor, "pairs_with", lambda *a: False)
        torch.manual_seed(0)
        layer = NSAAttention(cfg, backend="triton").to(DEVICE)
        for phi in (layer.phi_k, layer.phi_v):
            torch.nn.init.normal_(phi.pos_emb)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in layer.named_parameters()}))
    assert len(calls) == pairs
    (out, grads), (out_ref, grads_ref) = results
    assert rel_err(out, out_ref) <= FP32_TOL
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) <= FP32_TOL, name


@pytest.mark.parametrize("attention, fused_gate", [("nsa", False), ("nsa", True), ("dense", False)])
def test_attention_on_the_triton_backend_splits_and_rotates_q_k_v_as_the_torch_path(attention, fused_gate,
                                                                                       monkeypatch):
    """NSAAttention and DenseAttention on backend triton take their q, K and V (and with fused_gate NSA's gate
    logits) from nsa::rope_split: outputs and every parameter gradient match the same layer whose parts come
    from the torch path (the NSA core stays on triton in both, so only the split differs)."""
    from nsa_model import attention as attn_module
    from nsa_model.attention import build_attention

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32,
                      attention=attention, fused_gate=fused_gate,
                      nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    real = attn_module.rotate_and_split
    results = []
    for split_backend in ("triton", "torch"):
        if split_backend == "torch":  # the second layer's parts from the torch path, its core still on triton
            monkeypatch.setattr(attn_module, "rotate_and_split",
                                lambda y, rope, heads, dims, rotate, backend, position=0, into=None: real(
                                    y, rope, heads, dims, rotate, "torch", position, into))
        torch.manual_seed(0)
        layer = build_attention(cfg, backend="triton").to(DEVICE)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in layer.named_parameters()}))
    (out, grads), (out_ref, grads_ref) = results
    assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-6)
    for name in grads:
        assert torch.allclose(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("shape", [(2, 300, 3, 5, 6), (1, 7, 1, 2, 2), (3, 0, 2, 4, 4), (1, 40000, 1, 1, 1)])
def test_attention_stat_sums_match_the_pytorch_sums(shape):
    """nsa::attention_stat_sums: the three gate sums, the chosen slots and their distances t // l' - block, as the
    PyTorch formula gives them, over several programs with a partial last one (600 tokens in 32-token steps), one
    program with padded slot and gate columns, an empty sequence, and programs of two steps (40000 tokens)."""
    B, T, G, n, H = shape
    sel_block = 4
    gen = torch.Generator().manual_seed(sum(shape))
    t = torch.arange(T)[None, :, None, None]
    blocks = (torch.rand(B, T, G, n, generator=gen) * (t // sel_block + 1)).to(torch.int32)
    blocks[torch.rand(B, T, G, n, generator=gen) < 0.3] = -1
    gates = torch.rand(B, T, H, 3, generator=gen)
    sums = triton_impl.attention_stat_sums(blocks.to(DEVICE), gates.to(DEVICE), sel_block).cpu()
    valid = blocks >= 0
    distance = torch.where(valid, t // sel_block - blocks, 0)
    expected = torch.tensor([*gates.double().sum(dim=(0, 1, 2)).tolist(), valid.sum().item(), distance.sum().item()],
                            dtype=torch.float64)
    assert torch.allclose(sums.double(), expected, rtol=1e-5, atol=1e-3), (sums, expected)


@pytest.mark.parametrize("bad, match", [(dict(blocks_dtype=torch.int64), "blocks \\[B, T, G, n\\] int32"),
                                        (dict(gate_cols=2), "gates \\[B, T, H, 3\\]"),
                                        (dict(gate_tokens=5), "of the same B, T")])
def test_attention_stat_sums_refuses_inputs_it_does_not_sum(bad, match):
    blocks = torch.zeros(2, 6, 2, 3, dtype=bad.get("blocks_dtype", torch.int32)).to(DEVICE)
    gates = torch.rand(2, bad.get("gate_tokens", 6), 4, bad.get("gate_cols", 3)).to(DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_impl.attention_stat_sums(blocks, gates, 4)


def test_nsa_statistics_on_the_triton_backend_are_the_torch_backends(monkeypatch):
    """NSAAttention's stats buffer (gate means, blocks a query, their distance) from the kernel's sums equals the
    PyTorch sums' for the same layer's gates and selections."""
    from nsa_model.attention import build_attention

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    torch.manual_seed(0)
    layer = build_attention(cfg, backend="triton").to(DEVICE)
    with torch.no_grad():
        _, gates, blocks = layer._attend(torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    stats = {}
    for backend in ("triton", "torch"):
        layer.backend = backend
        layer._record_stats(gates, blocks)
        stats[backend] = layer.stats.clone()
    assert torch.allclose(stats["triton"], stats["torch"], rtol=1e-5, atol=1e-6), stats
    assert (stats["triton"][:3] > 0).all() and stats["triton"][3] > 1 and stats["triton"][4] > 0


@pytest.mark.parametrize("decode_kernel", ["torch", "triton"])
def test_cached_decoding_through_the_triton_backend_gives_its_full_forward(decode_kernel, monkeypatch):
    """Transformer.forward_cached on backend="triton": the prompt through nsa::core and nsa::rope_split, then each
    step's RoPE through rope_split at its position (its tables read at a device position) and each new compressed
    token through nsa::phi_mlp, with the decoding step's NSA in PyTorch or in kernels/decode.py: the logits of the
    model's full forward."""
    from nsa_model import ModelConfig, Transformer
    from nsa_model.attention import Compressor

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_impl, "_config", dataclasses.replace(triton_impl.launch_config(),
                                                                    decode_kernel=decode_kernel))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=24,
                      attention="nsa", nsa=NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=6))
    torch.manual_seed(0)
    model = Transformer(cfg, backend="triton").to(DEVICE).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    stacked, pair_weights = [], Compressor.pair_weights
    monkeypatch.setattr(Compressor, "pair_weights", lambda *a: stacked.append(1) or pair_weights(*a))
    with torch.no_grad():
        full, _ = model(tokens)
        stacked.clear()
        cache = model.new_cache()
        parts = [model.forward_cached(tokens[:, :9], cache)]
        made_by_prompt = len(stacked)
        parts += [model.forward_cached(tokens[:, t:t + 1], cache) for t in range(9, 24)]
    error = (torch.cat(parts, dim=1) - full).abs().max() / (full.max() - full.min())
    assert error <= (1e-2 if ON_GPU else 1e-5), error
    # phi's stacked pair weights: made once a layer for the prompt and kept (LayerCache.keep_weights), never again
    # by a step
    assert made_by_prompt == cfg.n_layers and len(stacked) == made_by_prompt


@pytest.mark.parametrize("B,T,H,G,Dk,Dv,cfg,positions", [
    (2, 37, 12, 2, 16, 8, NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=4, window=6),
     range(37)),  # 6 heads a group, Dk != Dv, T not a multiple of any block size, every position
    (1, 70, 4, 2, 8, 8, NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=3, window=20,
                                  n_local_blocks=1), [0, 6, 7, 15, 16, 33, 47, 64, 69]),
    (1, 60, 2, 1, 8, 8, NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=5, window=6),
     [5, 19, 31, 44, 59]),  # with k_cmp all zero: importance ties, which go to the lower block
])
def test_decoding_kernels_match_reference(B, T, H, G, Dk, Dv, cfg, positions, monkeypatch, chunk=None,
                                          segment=None, zero_k_cmp=None, parts=None):
    """The decoding kernels (kernels/decode.py: compressed partials, importance, top-n with one selected block or
    window tile a program, combine) against the float64 reference's row at each position, given the whole
    sequence's buffers (what lies past the position must not reach the result): output within fp32 rounding, the
    same blocks."""
    monkeypatch.setattr(triton_impl, "_config", dataclasses.replace(triton_impl.launch_config(),
                                                                    decode_kernel="triton"))
    if chunk is not None:
        monkeypatch.setattr(triton_impl, "_DECODE_CHUNK", chunk)
    if segment is not None:
        monkeypatch.setattr(triton_impl, "_DECODE_TOPN_SEGMENT", segment)
    if parts is not None:
        monkeypatch.setattr(triton_impl, "_DECODE_PARTS", parts)
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, seed=5, dtype=torch.float64)
    if cfg.n_selected == 5 if zero_k_cmp is None else zero_k_cmp:
        x["k_cmp"].zero_()
    names = ("q", "k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp", "gates")
    o_ref, blocks_ref = reference.nsa_attention(*(x[k] for k in names), cfg, scale=Dk ** -0.5, return_blocks=True)
    inputs = [x[k].float().to(DEVICE) for k in names]
    q, *buffers, gates = inputs
    for t in positions:
        o, blocks = triton_impl.decode_step(q[:, t], *buffers, gates[:, t], torch.tensor([t], device=DEVICE), cfg,
                                            Dk ** -0.5)
        assert torch.equal(blocks.cpu(), blocks_ref[:, t]), t
        assert (o.double().cpu() - o_ref[:, t]).abs().max() <= 1e-5 * o_ref[:, t].abs().max(), t


@pytest.mark.parametrize("segment,zero_k_cmp", [(None, False), (2, False), (8, False), (16, False), (4, True)])
def test_decoding_top_n_over_segments_picks_the_reference_blocks(segment, zero_k_cmp, monkeypatch):
    """The attend kernel's two-level top-n (the largest segment maxima, then the keys of those segments) at 75
    blocks (NB_PAD 128), n = 3, with segments of 2 to 16 blocks, and None: the one level _topn_segment picks at
    this shape (two from NB_PAD = 128 N_PAD). Positions from one block (fewer candidates than n: -1 slots) to the
    last; k_cmp zero: every importance ties, and the lowest blocks win."""
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_selected=3, window=8, n_local_blocks=1)
    assert triton_impl._topn_segment(128, 4) == 1 and triton_impl._topn_segment(4096, 16) == 16
    test_decoding_kernels_match_reference(1, 300, 4, 1, 8, 8, cfg, [2, 9, 40, 123, 250, 299], monkeypatch,
                                          segment=segment, zero_k_cmp=zero_k_cmp)


@pytest.mark.parametrize("parts,n", [(2, 4), (4, 4), (2, 5), (3, 5), (8, 5)])
def test_decoding_attend_programs_taking_several_blocks_match_reference(parts, n, monkeypatch):
    """The attend kernel with PARTS chosen blocks a program (many rows a step): a divisor of n, all n, and counts
    that leave the last program short (3 of n = 5: its third slot past n) or run past n (8); two batch rows, six
    heads a group, positions with fewer candidates than n (-1 slots) and with every block free."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=n, window=6)
    test_decoding_kernels_match_reference(2, 37, 12, 2, 16, 8, cfg, [3, 12, 20, 36], monkeypatch, parts=parts)


def test_attend_programs_take_more_blocks_only_where_rows_fill_the_gpu():
    """_attend_parts: the most blocks a program (a power of two up to n) that leave _DECODE_ATTEND_PROGRAMS
    programs: at nsa-125m (n = 16, 2 groups) one block below 64 (batch, group) rows, two from 64 (32 samples)."""
    assert triton_impl._DECODE_ATTEND_PROGRAMS == 512
    assert [triton_impl._attend_parts(rows, 16) for rows in (2, 32, 63, 64, 128, 512, 4096)] == [1, 1, 1, 2, 4, 16,
                                                                                                  16]
    assert triton_impl._attend_parts(1000, 3) == 2 and triton_impl._attend_parts(1, 1) == 1


def test_decoding_kernels_split_over_many_programs_match_reference(monkeypatch):
    """Four compressed chunks and three window tiles a (batch, group), merged two partials a load: every merge
    of partials runs, and a partly masked load of them. Six heads a group and 6 of 8 blocks free: a head's lse
    merged wrong moves its share of the importance, and the choice."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_selected=8, window=40, n_local_blocks=1)
    monkeypatch.setattr(triton_impl, "_DECODE_MERGE_ROWS", 2)  # the combine kernel's merges take several loads
    test_decoding_kernels_match_reference(1, 200, 12, 2, 8, 8, cfg, [3, 40, 63, 64, 130, 160, 180, 199],
                                          monkeypatch, chunk=16)


@pytest.mark.parametrize("decode_kernel", ["torch", "triton"])
def test_the_decoding_step_runs_the_kernels_the_launch_config_names(decode_kernel, monkeypatch):
    """ops/decode.py on the triton backend: kernels/decode.py where LaunchConfig.decode_kernel says "triton", its
    PyTorch ops where it says "torch"; the same output either way."""
    from nsa_model.ops.decode import nsa_decode_step

    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_impl, "_config", dataclasses.replace(triton_impl.launch_config(),
                                                                    decode_kernel=decode_kernel))
    calls, launch = [], triton_impl.decode_step
    monkeypatch.setattr(triton_impl, "decode_step", lambda *args: calls.append(1) or launch(*args))
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=4, window=6)
    x = make_inputs(1, 30, 4, 2, 8, 8, cfg, seed=6, dtype=torch.float32)
    q, *buffers, gates = (v.to(DEVICE) for v in x.values())
    o, _ = nsa_decode_step(q[:, 29], *buffers, gates[:, 29], torch.tensor([29], device=DEVICE), cfg, backend="triton")
    assert len(calls) == (decode_kernel == "triton")
    o_ref = reference.nsa_attention(*(v.double() for v in x.values()), cfg, scale=8 ** -0.5)[:, 29]
    assert (o.double().cpu() - o_ref).abs().max() <= 1e-5 * o_ref.abs().max()
