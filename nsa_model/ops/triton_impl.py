"""The Triton backend of the NSA core: autograd Functions around nsa_model/kernels.

Same pieces, signatures and meaning as ops/reference.py (see ops/__init__.py). Everything here is a fixed set of
kernel launches and batched tensor ops whose sizes depend only on shapes: no host sync, no loop over tokens.

Launch parameters (tile sizes, warps) and the kernel variants (selected fwd/dQ per query or per query tile,
gates eager or fused, range kernels masking every tile or only the edge tiles, delta eager or fused; the
defaults were chosen by the runs in bench/results/kernels-h100-*.md, v4 to v8, see kernels-notes.md) live in
one LaunchConfig; `use_launch_config` pins another one (tests and the benchmark use it). Under TRITON_INTERPRET=1
(set before import) the kernels run on CPU tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from nsa_model.config import NSAConfig
from nsa_model.kernels.block_index import (block_work_kernel, segment_ids_kernel, segment_offsets_kernel,
                                           segment_starts_kernel, tile_histogram_kernel, tile_scatter_kernel,
                                           tile_union_kernel)
from nsa_model.kernels.decode import (nsa_decode_attend_kernel, nsa_decode_cmp_kernel, nsa_decode_combine_kernel,
                                      nsa_decode_importance_kernel)
from nsa_model.kernels.compress import phi_bwd_rows_kernel, phi_bwd_w1_kernel, phi_bwd_x_kernel, phi_fwd_kernel
from nsa_model.kernels.delta import row_dot_kernel
from nsa_model.kernels.gates import gated_sum_bwd_kernel, gated_sum_fwd_kernel
from nsa_model.kernels.rope import rope_split_kernel
from nsa_model.kernels.range_attention import (range_attn_bwd_dkdv_kernel, range_attn_bwd_dq_kernel,
                                               range_attn_fwd_kernel)
from nsa_model.kernels.selected_attention import (selected_attn_bwd_dkdv_kernel, selected_attn_bwd_dq_kernel,
                                                  selected_attn_fwd_kernel, selected_dq_from_ds_kernel)
from nsa_model.kernels.selected_by_block import (selected_block_bwd_kernel, selected_block_fwd_kernel,
                                                 selected_combine_kernel, selected_dq_sum_kernel)
from nsa_model.kernels.selected_tiled import (selected_tiled_bwd_dq_kernel, selected_tiled_dq_from_ds_kernel,
                                             selected_tiled_fwd_kernel)
from nsa_model.kernels.selection import select_blocks_kernel
from nsa_model.kernels.stats import attention_stats_kernel

# triton.jit decided at import: an interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors.
INTERPRETED = not isinstance(range_attn_fwd_kernel, triton.runtime.JITFunction)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# selected branch: query-driven (one program per query, or per tile of queries walking the union of their blocks;
# dK/dV by inverted index), key-block-driven (by_block: fwd partials + combine, one fused backward), or auto
# (by_block up to slc_auto_max_hpg heads per group, tiled above: bench/results/kernels-notes.md, v6), or
# tiled_by_block: tiled's forward (a tile's partial outputs stay on chip: no partials, no combine pass) with
# by_block's fused backward
SELECTED_KERNELS = ("per_query", "tiled", "by_block", "tiled_by_block", "auto")
BY_BLOCK_BACKWARD = ("by_block", "tiled_by_block")  # the variants whose backward is by_block's
PARTIAL_DTYPES = ("fp32", "input")  # by_block: partial outputs and dQ contributions in float32 or the input dtype
SELECTED_DQ = ("partial", "atomic")  # by_block dQ: per-slot contributions summed by a kernel, or fp32 atomics
SELECTED_DKDV = ("inverted", "by_block")  # dK/dV of per_query/tiled: padded-heads kernel, or the by_block one
# dQ of the query-driven variants (tiled, per_query): recomputing s, p and dp (three products a block; the tiled
# kernel for all the tile's rows), or from the ds that by_block's dK/dV stores at each (query, block) slot (one
# product a block, member rows only; needs slc_dkdv "by_block", which then runs first; kernels-notes.md v55)
QUERY_DQ = ("recompute", "ds")
GATE_KERNELS = ("torch", "fused")  # gated combination: eager PyTorch ops, or one Triton kernel each way
# contiguous tiles (the range and selection kernels' q, do, k, v; the selected kernels' key blocks): through
# tensor descriptors where the layout allows (_tile_args; v23), or by pointer loads
RANGE_LOADS = ("tma", "pointer")
RANGE_KERNELS = ("masked", "split")  # compressed/window: every tile masked (v4), or only the edge tiles (v5)
DELTA_KERNELS = ("torch", "fused")  # backward row term sum(do * o): eager fp32 ops, or one Triton kernel
WINDOW_DKDV = ("group", "head")  # window dK/dV: one program per key tile and group (stores) or per head (atomics)
# nsa::core's compressed and window branches: their dQ as one two-range launch (each query tile and do loaded once,
# one dQ for both; with the fused gate kernel only, whose backward gives both branches the same do), or apart
RANGE_PAIR = ("fused", "apart")
# phi = mlp of the attention module (outside the core): our kernels (one launch forward, three backward), or
# PyTorch's unfold, GEMMs and GELU (attention.Compressor; kernels-notes.md v29)
PHI_KERNELS = ("fused", "torch")
# by_block's dQ slot sum in nsa::core's backward: a pass of its own (selected_dq_sum_kernel, adding the range
# branches' dQ), or in the epilogue of the compressed and window branches' two-range dQ kernel, which then runs
# after the selected branch (kernels-notes.md v29)
SLOT_SUMS = ("pass", "range_dq")
# nsa::core's forward: the selected branch's last pass (by_block's combine, the tiled, tiled_by_block or per-query
# forward), then the gate pass; or that pass also summing the gated output in its epilogue (one pass less;
# kernels-notes.md v40, v54)
SLC_COMBINES = ("plain", "gated")
# by_block's inverted index: per-tile histograms, prefix sums and in-register sorts of each tile's slots (three
# launches), or PyTorch's stable radix sort of every slot's segment key (kernels/block_index.py); auto: count where
# its prefix-sum program has at most _COUNT_AUTO_CELLS (block, tile) counts, sort beyond (kernels-notes.md v47)
INDEX_BUILDS = ("auto", "count", "sort")
DECODE_KERNELS = ("torch", "triton")  # LaunchConfig.decode_kernel: a decoding step's NSA


RANGE_TILE_FIELDS = ("range_fwd", "range_dq", "range_dkdv", "range_fwd_d64", "range_dq_d64", "range_dkdv_d64")
SELECT_FIELDS = ("select", "select_d128", "select_d64")
BOOL_FIELDS = ("side_stream", "range_dq_last")


@dataclass(frozen=True)
class LaunchConfig:
    # Compressed/window kernels, each its own (query tile, key tile, warps, stages): forward, dQ, dK/dV; for head
    # dims > 64 and, leaving registers for larger tiles, for head dims <= 64.
    # v23 sweep, TMA loads: 3 stages -4% at paper 8k, -9% at 64k; v60 (heads packed, H200): 32-key tiles, NSA
    # -0.6% at paper 8k (the kernel -6% to -8%), a tie at 64k (two calls)
    range_fwd: tuple[int, int, int, int] = (64, 32, 4, 3)
    # v60 (H200, heads packed: 65 KB of shared memory a program at 2 stages): 3 stages took the dQ kernel 13.8 ->
    # 12.2-12.5 ms at paper 64k, 4.6-4.7 -> 4.1-4.3 at 32k (NSA -0.3% to -0.5%); 4 stages lost (18 ms)
    range_dq: tuple[int, int, int, int] = (64, 64, 4, 3)
    range_dkdv: tuple[int, int, int, int] = (64, 64, 4, 2)
    range_fwd_d64: tuple[int, int, int, int] = (64, 64, 4, 2)
    range_dq_d64: tuple[int, int, int, int] = (64, 32, 4, 3)  # v8 sweep (cmp + win fwd+bwd): -23% at 16 x 2k
    range_dkdv_d64: tuple[int, int, int, int] = (64, 64, 4, 3)  # v8 sweep: -8% at 32k
    # Selection kernel, (query tile, chunk splits, warps): it walks chunks of n_pad * 2**splits blocks
    # (kernels/selection.py); for head dims <= 64, 65 to 128, and above. Since v34/v35 made a chunk's own work
    # cheaper, 32-block chunks halve the paper shape's selection (16 heads of 128 a group: 11.8 -> 6.5 ms at 64k on
    # the H100) while the 125M shape's stays fastest at 16 blocks (kernels-notes.md v36). Above 128 the wider
    # chunk's key tiles do not fit in shared memory (head dim 192: 232 KB, over the H100's 227).
    select: tuple[int, int, int] = (64, 0, 4)
    select_d128: tuple[int, int, int] = (64, 1, 4)
    select_d64: tuple[int, int, int] = (64, 0, 4)
    # compressed dK/dV: split the query axis until about this many programs (v26f: beside the selected branch on the
    # second stream, 1024 beat 2048 by 0.05 ms at 125m 4 x 8k and 16 x 2k, a tie at paper 64k; 512 lost 0.9 ms there)
    range_dkdv_programs: int = 1024
    # compressed dK/dV: > 0 splits the query axis into absolute chunks of this many queries instead where T is
    # longer, chunk-major, so that the programs running together share one head's q and dO rows in L2
    # (ALIGNED_CHUNKS); 0: off. v57 on an H200, NSA under CUDA graphs: 4096 took paper 8k -0.5%, 32k -2.2%,
    # 64k -1.9%, 128k -5.4%, 125m 4 x 8k -0.6%, 1 x 32k -1.2%
    range_dkdv_q_chunk: int = 4096
    # range dK/dV programs over several heads (the window's, one program a group): each run of the edge split loops
    # over (query tile, head) pairs for up to this many heads at a time (the largest divisor of the program's heads
    # not above it), a tile's heads in turn; 1: the three runs once per head (3 x heads short loops, each filling
    # and draining its pipeline). All of a tile's heads at once, the key tiles that run together read more query
    # rows than the L2 holds: at paper 64k (16 heads of 128) the window dK/dV's L2 hits fall from 81% to 15% and it
    # takes 6.2 ms against 5.1 (v83). On an H200, NSA under CUDA graphs: nsa-125m (6 heads of 64) all against 1
    # -0.8% to -1.5% (v82); the paper shapes 4 against 1 -0.2% to -0.6%, all +0.7% to +2% (v82, v83)
    range_dkdv_loop_heads: int = 4
    range_dkdv_loop_heads_d64: int = 16  # head dims <= 64
    # compressed and window forward and dQ: at most this many heads of a group share a tile's rows (a power of two;
    # the largest power of two that divides the group's heads and the query tile runs; 1: one head a tile). Every
    # head of a group sees the same keys, so a packed tile reads each key tile once for all its heads. v60 on an
    # H200, NSA under CUDA graphs: paper 8k -1.1%, 32k -1.3%, 64k -1.2% (the dQ kernel -7%) at 16 heads; nsa-125m
    # (6 heads a group: 2) -0.5% to -0.9%
    range_heads: int = 16
    slc_warps: int = 2  # per-query selected forward and dQ (2 beat 4 in the v2 sweep on H100; v37 again)
    # per-query forward and dQ. v37 (H100) took 2 -> 3 for 3% off paper 16k's selected branch, which auto now runs
    # tiled; v59 (H200, where auto runs per_query: paper 32k-128k) took 3 -> 2 for the forward 8-11% faster
    # (64k: 16.5-16.6 -> 14.9-15.0 ms, NSA 98.9-99.0 -> 96.8-98.3)
    slc_stages: int = 2
    # the tiled forward at head dims <= 64 and the tiled dQ (v37: 3 stages cost paper 8k's dQ 1.64 -> 1.83 ms)
    slc_tile_stages: int = 2
    # the tiled forward's stages at head dims > 64 (v25; v24 measured 3 stages at paper 8k: 1.515 -> 1.422 ms,
    # while at head dim 64 they lost, 0.418 -> 0.485 at 16 x 2k, and the tiled dQ lost at both)
    slc_tile_fwd_stages_d128: int = 3
    dkdv_rows: int = 64  # rows (choosers x heads) per step of the selected dK/dV kernel
    dkdv_chunk: int = 256  # choosers of one block handled by one program
    dkdv_warps: int = 4
    slc_kernel: str = "auto"  # one of SELECTED_KERNELS
    slc_auto_max_hpg: int = 8  # auto: by_block for groups of at most this many heads, query-driven for larger ones
    slc_auto_tiled_fwd_blocks: int = 2  # auto, small groups: tiled_by_block up to this many times n blocks (v11)
    # auto, large groups: tiled up to this many times n blocks, per_query beyond (v53 on the H100, paper shapes:
    # tiled took paper 16k, 16n blocks, from 18.24-18.36 to 17.40-17.56 ms; 32k tied; 64k lost, 112.1 -> 115.0)
    slc_auto_tiled_blocks: int = 16
    slc_block_rows: int = 64  # by_block: matrix rows (choosers x heads, unpadded) per step
    slc_block_chunk: int = 512  # by_block: choosers per program (v8 sweep: 512 beat 256 by 3% at 32k, tie at 2k)
    slc_block_warps: int = 4
    slc_block_stages: int = 3  # where by_block does not prefetch; v6c: 3 beat 2 at every 125M shape (4 ties 3)
    slc_block_prefetch_dims: int = 64  # by_block: prefetch the next step's rows at head dims up to this (0: off; v24)
    slc_block_fwd_maxnreg: int = 168  # by_block forward with prefetch: registers per thread at most (3 programs/SM)
    slc_partial: str = "input"  # one of PARTIAL_DTYPES
    slc_dq: str = "partial"  # one of SELECTED_DQ
    slc_dkdv: str = "by_block"  # one of SELECTED_DKDV
    # one of QUERY_DQ; v55 on an H200, paper shapes: 8k 0.964 -> 0.906-0.909 of cuDNN, 64k 0.239 -> 0.226
    slc_query_dq: str = "ds"
    slc_ds_warps: int = 4  # the tiled dQ from stored ds (slc_query_dq "ds")
    slc_ds_stages: int = 2
    slc_tile_rows: int = 64  # rows (queries x heads, unpadded) of one program of the tiled selected kernels
    slc_tile_warps: int = 4
    gate_kernel: str = "fused"  # one of GATE_KERNELS
    range_kernel: str = "split"  # one of RANGE_KERNELS
    range_loads: str = "tma"  # one of RANGE_LOADS
    delta_kernel: str = "fused"  # one of DELTA_KERNELS
    window_dkdv: str = "group"  # one of WINDOW_DKDV
    range_pair: str = "fused"  # one of RANGE_PAIR (kernels-notes.md, v17)
    side_stream: bool = True  # nsa::core's window forward and range dK/dV on a second CUDA stream (_Beside; v26)
    # nsa::core's backward under the tiled selected kernels: the selected backward first, then the two ranges' dQ
    # added into its dq, so that the selected kernels run beside the range dK/dV on the second stream and the
    # tiled dQ from ds adds into nothing. v58e on an H200, NSA under CUDA graphs: paper 8k 6.66 -> 6.48 ms (-2.8%),
    # 16k -1.7%; under per_query (paper 32k-128k) a tie at 32k and 128k and +0.5% at 64k, so not there.
    range_dq_last: bool = True
    phi_kernel: str = "fused"  # one of PHI_KERNELS
    slc_slot_sum: str = "range_dq"  # one of SLOT_SUMS
    slc_combine: str = "gated"  # one of SLC_COMBINES
    phi_rows: int = 32  # compressed tokens per program of phi's forward and its row backward (v29: 64 lost)
    index_build: str = "auto"  # one of INDEX_BUILDS
    # A decoding step's NSA (outside the core; ops/decode.py): "triton", kernels/decode.py's four launches a layer
    # (17 us a layer at nsa-125m, 32k positions, on an H200), or "torch", its PyTorch ops (about a hundred small
    # kernels a layer: the graph step 6.4 ms a token against the kernels' 1.60 ms at the time; v68).
    decode_kernel: str = "triton"  # one of DECODE_KERNELS

    def __post_init__(self) -> None:
        choices = {"slc_kernel": SELECTED_KERNELS, "gate_kernel": GATE_KERNELS, "range_kernel": RANGE_KERNELS,
                   "delta_kernel": DELTA_KERNELS, "window_dkdv": WINDOW_DKDV, "slc_partial": PARTIAL_DTYPES,
                   "slc_dq": SELECTED_DQ, "slc_dkdv": SELECTED_DKDV, "slc_query_dq": QUERY_DQ, "range_pair": RANGE_PAIR,
                   "range_loads": RANGE_LOADS, "phi_kernel": PHI_KERNELS,
                   "slc_slot_sum": SLOT_SUMS, "slc_combine": SLC_COMBINES, "index_build": INDEX_BUILDS,
                   "decode_kernel": DECODE_KERNELS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LaunchConfig.{name}: must be one of {allowed}, got {getattr(self, name)!r}")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LaunchConfig.{name}: must be a bool, got {getattr(self, name)!r}")
        for f in dataclasses.fields(self):
            if f.name in choices or f.name in RANGE_TILE_FIELDS or f.name in BOOL_FIELDS or f.name in SELECT_FIELDS:
                continue
            value = getattr(self, f.name)
            zero_ok = ("slc_auto_tiled_fwd_blocks", "slc_auto_tiled_blocks", "slc_block_prefetch_dims",
                       "range_dkdv_q_chunk")
            low = 0 if f.name in zero_ok else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"LaunchConfig.{f.name}: must be an int >= {low}, got {value!r}")
        for name in RANGE_TILE_FIELDS:
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 4 or not all(isinstance(x, int) for x in value)
                    or min(value) < 1):
                raise ValueError(f"LaunchConfig.{name}: must be a tuple of 4 positive ints (query tile, key tile, "
                                 f"warps, stages), got {value!r}")
        for name in SELECT_FIELDS:
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3 or not all(isinstance(x, int) for x in value)
                    or value[1] < 0 or value[2] < 1 or value[2] & (value[2] - 1)):
                raise ValueError(f"LaunchConfig.{name}: must be a tuple (query tile, chunk splits >= 0, warps a power "
                                 f"of two), got {value!r}")
        if self.slc_query_dq == "ds" and self.slc_dkdv != "by_block":
            raise ValueError("LaunchConfig.slc_query_dq='ds' reads the ds that by_block's dK/dV stores: it needs "
                             f"slc_dkdv='by_block', got slc_dkdv={self.slc_dkdv!r}")
        if self.range_heads & (self.range_heads - 1):
            raise ValueError(f"LaunchConfig.range_heads: must be a power of two, got {self.range_heads}")
        tiles = [(name, getattr(self, name)) for name in ("dkdv_rows", "slc_tile_rows", "slc_block_rows", "phi_rows")]
        tiles += [(f"{name} tiles", getattr(self, name)[i]) for name in RANGE_TILE_FIELDS for i in (0, 1)]
        tiles += [(f"{name} query tile", getattr(self, name)[0]) for name in SELECT_FIELDS]
        for name, value in tiles:
            if value < 16 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name}: must be a power of two >= 16, got {value}")


# Small tiles in the interpreter: it costs per program and per op, and CI shapes are small.
_INTERPRETER_CONFIG = LaunchConfig(select=(128, 0, 4), select_d128=(128, 1, 4), select_d64=(128, 0, 4),
                                   dkdv_rows=32, dkdv_chunk=64, slc_block_chunk=64)
_config = _INTERPRETER_CONFIG if INTERPRETED else LaunchConfig()


def launch_config() -> LaunchConfig:
    return _config


def set_launch_config(config: LaunchConfig) -> None:
    global _config
    if not isinstance(config, LaunchConfig):
        raise ValueError(f"launch config: expected a LaunchConfig, got {config!r}")
    _config = config


@contextlib.contextmanager
def use_launch_config(config: LaunchConfig):
    """Run the kernels with `config` inside the block."""
    previous = _config
    set_launch_config(config)
    try:
        yield config
    finally:
        set_launch_config(previous)


def _check_inputs(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values()))
    for name, x in tensors.items():
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: the triton backend takes {SUPPORTED_DTYPES}, got {x.dtype}")
        if x.dtype != first.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from {first.dtype} of the other inputs")
        if INTERPRETED and x.is_cuda:
            raise ValueError(f"{name}: the Triton interpreter (TRITON_INTERPRET=1) runs on CPU tensors, got {x.device}")
        if not INTERPRETED and not x.is_cuda:
            raise ValueError(f"{name}: the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                             f"import), got a tensor on {x.device}")


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products (tf32 would miss the fp32 tolerance); 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _slc_launch() -> dict:
    return dict(num_warps=_config.slc_warps, num_stages=_config.slc_stages)


def _head_dims(q: torch.Tensor, v: torch.Tensor) -> dict:
    dk, dv = q.shape[-1], v.shape[-1]
    return dict(DK=dk, DV=dv, BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), DOT_PRECISION=_dot_precision(q.dtype))


def _range_launch(q: torch.Tensor, v: torch.Tensor, kernel: str) -> dict:
    """Tiles and launch parameters of one range kernel ("fwd", "dq" or "dkdv") for these head dims."""
    d64 = "_d64" if max(q.shape[-1], v.shape[-1]) <= 64 else ""
    block_m, block_n, warps, stages = getattr(_config, f"range_{kernel}{d64}")
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                EDGE_SPLIT=_config.range_kernel == "split")


def _range_heads(launch: dict, H: int, G: int) -> int:
    """Heads of a group in one tile's rows of the range forward and dQ (range_heads, kernels/range_attention.py's
    HEADS): the largest power of two that divides the group's H // G heads and the query tile, at most
    range_heads."""
    heads = 1
    while heads * 2 <= _config.range_heads and (H // G) % (heads * 2) == 0 and launch["BLOCK_M"] % (heads * 2) == 0:
        heads *= 2
    return heads


def _tma_device(x: torch.Tensor) -> bool:
    """Hopper or later (the tensor memory accelerator), or the interpreter, which runs descriptors on the CPU."""
    return INTERPRETED or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)


def _tile_args(launch: dict, queries: dict[str, torch.Tensor], keys: dict[str, torch.Tensor],
               heads: int = 1) -> dict:
    """The tile arguments of a kernel with a TMA switch (range, selection, selected): TMA=True and a descriptor per
    tensor where range_loads = "tma" and every tensor allows one, else TMA=False and the tensors themselves
    (unread). queries: name -> [B, T, H, D] contiguous, read in [BLOCK_M, D] tiles; keys: name -> [B, N, G, D]
    as _kv_rows gives them, read in [BLOCK_N, D] tiles. A descriptor needs what the copy engine needs: a head dim
    that is its own tile (a power of two: a padded tile would read the next head's values, not zeros), tiles of at
    most 256 rows, 16-byte aligned rows and base, and a non-empty tensor; tensors that miss one (head dim 192, no
    compressed token yet) take the pointer loads. heads > 1: query tiles of BLOCK_M // heads queries times heads
    heads (the range kernels' HEADS), through 3-D descriptors over [B * T, H, D]."""
    tensors = {**queries, **keys}
    usable = _config.range_loads == "tma" and max(launch["BLOCK_M"], launch["BLOCK_N"]) <= 256 and all(
        x.numel() > 0 and _pow2(x.shape[-1]) == x.shape[-1] and x.data_ptr() % 16 == 0
        and (x.stride(1) * x.element_size()) % 16 == 0 and _tma_device(x) for x in tensors.values())
    if not usable:
        return dict(TMA=False, **tensors)
    out = dict(TMA=True)
    for name, x in tensors.items():
        B, N, width, D = x.shape
        if name in queries and heads > 1:
            out[name] = TensorDescriptor(x, [B * N, width, D], [x.stride(1), D, 1],
                                         [launch["BLOCK_M"] // heads, heads, D])
            continue
        block = launch["BLOCK_M"] if name in queries else launch["BLOCK_N"]
        out[name] = TensorDescriptor(x, [B * N, width * D], [x.stride(1), 1], [block, D])
    return out


def _kv_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V [B, N, G, D] in a layout the kernels read in place: each token's G x D values contiguous and the
    tokens evenly spaced over the whole batch, x.stride(1) elements apart (the kernels' K_ROW / V_ROW). One key
    set sliced out of NSAAttention's stacked projection [B, T, sets, G, D] is such a tensor, so the core reads
    it where it lies instead of copying it (the slc and win sets: 8 copies per layer, forward and backward);
    other layouts are copied."""
    B, N, G, D = x.shape
    if x.stride(3) == 1 and (G == 1 or x.stride(2) == D) and (B == 1 or x.stride(0) == N * x.stride(1)):
        return x
    return x.contiguous()


def _kv_strides(k: torch.Tensor, v: torch.Tensor) -> dict:
    return dict(K_ROW=k.stride(1), V_ROW=v.stride(1))


def _fp32_accumulators(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed float32 dK and dV accumulators, contiguous whatever the layout of k and v. For 16-bit k, v they are
    carved from one buffer (one fill launch instead of two) and the casts at the end give each gradient its own
    memory; for float32 ones the accumulators are the gradients themselves, so each gets its own (a custom op's
    outputs may not alias one another)."""
    if k.dtype == torch.float32:
        return (torch.zeros(k.shape, dtype=k.dtype, device=k.device),
                torch.zeros(v.shape, dtype=v.dtype, device=v.device))
    flat = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)
    return flat[:k.numel()].view(k.shape), flat[k.numel():].view(v.shape)


_DELTA_ROWS = 32  # (b, t, h) rows per program of the delta kernel


def _delta(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """[B, T, H] fp32 sum over the head dim of do * o (the row term of an attention backward)."""
    if _config.delta_kernel == "torch":
        return (do.float() * o.float()).sum(-1)
    do, o = do.contiguous(), o.contiguous()
    d = o.shape[-1]
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device)
    rows = delta.numel()
    if rows:
        row_dot_kernel[(triton.cdiv(rows, _DELTA_ROWS),)](do, o, delta, rows, D=d, BLOCK_R=_DELTA_ROWS,
                                                          BLOCK_D=_pow2(d))
    return delta


# --- compressed and window branches: attention over a range of keys ------------------------------------------

def _range_fwd(q, k, v, key_stride: int, key_offset: int, window: int, scale: float):
    """(o, lse) of attention over a range of keys: query t sees key j iff 0 <= t - (j*key_stride + key_offset)
    < window (kernels/range_attention.py)."""
    q = q.contiguous()
    o, lse = _range_outputs(q, v)
    _range_fwd_into(q, k, v, o, lse, q.shape[1], key_stride, key_offset, window, scale)
    return o, lse


def _range_outputs(q, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty o [B, T, H, Dv] (q's dtype) and lse [B, T, H] (float32) of _range_fwd."""
    return (torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))


def _range_fwd_into(q, k, v, o, lse, num_queries: int, key_stride: int, key_offset: int, window: int,
                    scale: float) -> None:
    """_range_fwd for queries t < num_queries only, written into rows t < num_queries of o and lse (contiguous
    [B, T, H, Dv] and [B, T, H]); the other rows are left as they are."""
    _check_scale(scale)
    k, v = _kv_rows(k), _kv_rows(v)
    B, T, H, _ = q.shape
    num_keys, G = k.shape[1], k.shape[2]
    launch = _range_launch(q, v, "fwd")
    heads = _range_heads(launch, H, G)
    range_attn_fwd_kernel[(triton.cdiv(num_queries, launch["BLOCK_M"] // heads), B * H // heads)](
        q, k, v, O=o, LSE=lse, T=T, num_queries=num_queries, num_keys=num_keys, scale=scale, key_stride=key_stride,
        key_offset=key_offset, window=window, **_kv_strides(k, v), H=H, G=G, **_head_dims(q, v), **launch,
        **_tile_args(launch, dict(QD=q), dict(KD=k, VD=v), heads), HEADS=heads)


def _range_bwd(q, k, v, o, lse, do, key_stride: int, key_offset: int, window: int, scale: float, delta=None):
    """(dq, dk, dv) of _range_fwd; delta = rowsum(do * o) [B,T,H] fp32 when the caller has it already."""
    q, k, v, do = q.contiguous(), _kv_rows(k), _kv_rows(v), do.contiguous()
    delta = _delta(do, o) if delta is None else delta
    dq = torch.empty_like(q)
    _range_dq_into(q, k, v, do, lse, delta, dq, q.shape[1], key_stride, key_offset, window, scale)
    return (dq, *_range_dkdv(q, k, v, do, lse, delta, key_stride, key_offset, window, scale))


def _range_dkdv(q, k, v, do, lse, delta, key_stride: int, key_offset: int, window: int, scale: float):
    """(dk, dv) of _range_fwd from every query (q, do contiguous; k, v as _kv_rows gives them)."""
    dk, dv = _range_dkdv_outputs(q, k, v, window)
    _range_dkdv_into(q, k, v, do, lse, delta, dk, dv, q.shape[1], k.shape[1], key_stride, key_offset, window, scale)
    return dk.to(k.dtype), dv.to(v.dtype)


def _range_dkdv_outputs(q, k, v, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What _range_dkdv_into writes dK, dV into: float32 accumulators where programs add (atomic), to be cast once
    at the end; else empty tensors in k's and v's dtype, each key row stored once (no zero fill, no cast)."""
    atomic = _range_dkdv_split(q, k, v, q.shape[1], window)[0]
    if atomic:
        return _fp32_accumulators(k, v)
    return (torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _range_dq_into(q, k, v, do, lse, delta, dq, num_queries: int, key_stride: int, key_offset: int, window: int,
                   scale: float, accumulate: bool = False, second=None, slots=None) -> None:
    """dQ of _range_fwd for queries t < num_queries into those rows of dq, or added to them (accumulate). second =
    (k2, v2, lse2, delta2, key_stride2, key_offset2, window2): dq is the sum over both ranges (nsa::core's
    backward: each query tile and its do loaded once, one store). slots = (dq_slots, blocks): by_block's dQ
    contributions per slot, added in too (slc_slot_sum = "range_dq")."""
    k, v = _kv_rows(k), _kv_rows(v)
    B, T, H, _ = q.shape
    num_keys, G = k.shape[1], k.shape[2]
    k2, v2, lse2, delta2, *range2 = (second if second is not None
                                     else (k, v, lse, delta, key_stride, key_offset, window))
    k2, v2 = _kv_rows(k2), _kv_rows(v2)
    launch = _range_launch(q, v, "dq")
    heads = _range_heads(launch, H, G)
    key_sets = dict(KD=k, VD=v) if second is None else dict(KD=k, VD=v, K2D=k2, V2D=v2)
    tiles = _tile_args(launch, dict(QD=q, DOD=do), key_sets, heads)
    tiles.setdefault("K2D", tiles["KD"])  # one range: unread
    tiles.setdefault("V2D", tiles["VD"])
    range_attn_bwd_dq_kernel[(triton.cdiv(num_queries, launch["BLOCK_M"] // heads), B * H // heads)](
        q, k, v, do, LSE=lse, DELTA=delta, DQ=dq, T=T, num_queries=num_queries, num_keys=num_keys, scale=scale,
        key_stride=key_stride, key_offset=key_offset, window=window, K_ROW=k.stride(1), V_ROW=v.stride(1), K2=k2,
        V2=v2, LSE2=lse2, DELTA2=delta2, num_keys2=k2.shape[1], key_stride2=range2[0], key_offset2=range2[1],
        window2=range2[2], K2_ROW=k2.stride(1), V2_ROW=v2.stride(1), H=H, G=G, **_head_dims(q, v),
        ACCUMULATE=accumulate, TWO_RANGES=second is not None, HEADS=heads, **launch, **tiles,
        **({} if slots is None else dict(DQ_SLOTS=slots[0], SLOT_BLOCKS=slots[1], N_SLOTS=slots[1].shape[-1])))


_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third axes


def _range_dkdv_split(q, k, v, num_queries: int, window: int) -> tuple[bool, int, int, bool]:
    """(atomic, head_split, q_chunk, aligned) of the dK/dV kernel. A key tile of the compressed branch is seen by up
    to T queries: one head per program and chunks of the query axis (atomic adds) spread that over the GPU. A window
    tile is seen by ~w queries: one program per group is enough (window_dkdv = "group"), or one per head (atomic
    adds). aligned: the compressed branch's chunks are absolute (range_dkdv_q_chunk, where T is longer than one
    chunk); its grid then has the B * H head slices on its second axis, which CUDA caps at 65535, so beyond that
    the relative chunks run."""
    launch = _range_launch(q, v, "dkdv")
    bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]
    B, _, H, _ = q.shape
    G = k.shape[2]
    key_tiles, query_tiles = triton.cdiv(min(k.shape[1], num_queries), bn), triton.cdiv(num_queries, bm)
    if window >= num_queries and 0 < _config.range_dkdv_q_chunk < num_queries and B * H <= _MAX_GRID_YZ:
        q_chunk = triton.cdiv(_config.range_dkdv_q_chunk, bm) * bm
        return True, H // G, q_chunk, True
    elif window >= num_queries:
        head_split = H // G
        chunks = triton.cdiv(_config.range_dkdv_programs, max(key_tiles, 1) * B * G * head_split)
        q_chunk = triton.cdiv(query_tiles, min(max(chunks, 1), max(query_tiles, 1))) * bm
    else:
        head_split = H // G if _config.window_dkdv == "head" else 1
        q_chunk = query_tiles * bm
    return head_split > 1 or q_chunk < num_queries, head_split, q_chunk, False


def _range_dkdv_into(q, k, v, do, lse, delta, dk, dv, num_queries: int, num_key_rows: int, key_stride: int,
                     key_offset: int, window: int, scale: float) -> None:
    """dK, dV of _range_fwd from queries t < num_queries, for keys j < num_key_rows: stored into dk, dv (input
    dtype) or, where _range_dkdv_split says atomic, added into them (float32 accumulators)."""
    B, T, H, _ = q.shape
    num_keys, G = k.shape[1], k.shape[2]
    launch = _range_launch(q, v, "dkdv")
    atomic, head_split, q_chunk, aligned = _range_dkdv_split(q, k, v, num_queries, window)
    if num_key_rows > 0 and num_queries > 0:
        grid = (B * G * head_split, triton.cdiv(num_key_rows, launch["BLOCK_N"]), triton.cdiv(num_queries, q_chunk))
        range_attn_bwd_dkdv_kernel[(grid[1], grid[0], grid[2]) if aligned else grid](
            q, k, v, do, LSE=lse, DELTA=delta, DK_ACC=dk, DV_ACC=dv, T=T, num_queries=num_queries, num_keys=num_keys,
            scale=scale, key_stride=key_stride, key_offset=key_offset, window=window, q_chunk=q_chunk,
            **_kv_strides(k, v), HEAD_SPLIT=head_split, ATOMIC=atomic, H=H, G=G, **_head_dims(q, v), **launch,
            **_tile_args(launch, dict(QD=q, DOD=do), dict(KD=k, VD=v)), ALIGNED_CHUNKS=aligned,
            LOOP_HEADS=_loop_heads(q, v, H // (G * head_split)))


def _loop_heads(q: torch.Tensor, v: torch.Tensor, heads: int) -> int:
    """Heads in each tile loop of a range dK/dV program over `heads` heads: the largest divisor of heads not above
    range_dkdv_loop_heads (range_dkdv_loop_heads_d64 at head dims <= 64)."""
    d64 = max(q.shape[-1], v.shape[-1]) <= 64
    limit = _config.range_dkdv_loop_heads_d64 if d64 else _config.range_dkdv_loop_heads
    return max(d for d in range(1, min(limit, heads) + 1) if heads % d == 0)


def _range_pair_fused() -> bool:
    """Whether nsa::core runs its compressed and window branches' dQ as one two-range launch (range_pair): their
    backward shares one do only when the gates are folded into the lse (gate_kernel = "fused")."""
    return _config.range_pair == "fused" and _config.gate_kernel == "fused"


def _cmp_range(cmp_block: int, cmp_stride: int, T: int) -> tuple[int, int, int]:
    """(key_stride, key_offset, window) of the compressed branch: token j ends at j*d + l - 1, and no lower
    bound (a window of T covers every earlier token)."""
    return cmp_stride, cmp_block - 1, T


def _win_range(window: int, T: int) -> tuple[int, int, int]:
    """(key_stride, key_offset, window) of the window branch: keys are the raw positions t - w + 1 .. t."""
    return 1, 0, min(window, T)


class _RangeAttention(torch.autograd.Function):
    """The compressed and window branches on their own (the whole core is the nsa::core op below)."""

    @staticmethod
    def forward(ctx, q, k, v, key_stride: int, key_offset: int, window: int, scale: float):
        o, lse = _range_fwd(q, k, v, key_stride, key_offset, window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.params = (key_stride, key_offset, window, scale)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_range_bwd(q, k, v, o, lse, do, *ctx.params), None, None, None, None)


def compressed_attention(q, k_cmp, v_cmp, cfg: NSAConfig, scale: float):
    """o_cmp [B,T,H,Dv] and lse [B,T,H] float32 (-inf where no compressed token is visible)."""
    _check_inputs(q=q, k_cmp=k_cmp, v_cmp=v_cmp)
    return _RangeAttention.apply(q, k_cmp, v_cmp, *_cmp_range(cfg.cmp_block, cfg.cmp_stride, q.shape[1]),
                                scale)


def window_attention(q, k, v, window: int, scale: float):
    """Each query attends to positions max(0, t - w + 1) .. t."""
    _check_inputs(q=q, k=k, v=v)
    if window <= 0:
        raise ValueError(f"window: must be positive, got {window}")
    o, _ = _RangeAttention.apply(q, k, v, *_win_range(window, q.shape[1]), scale)
    return o


# --- selection ------------------------------------------------------------------------------------------------

@torch.no_grad()
def select_blocks(q, k_cmp, lse, cfg: NSAConfig, scale: float):
    """blocks [B,T,G,n] int32, in decreasing importance (forced first), -1 where fewer than n exist."""
    _check_inputs(q=q, k_cmp=k_cmp)
    q, k_cmp, lse = q.contiguous(), k_cmp.contiguous(), lse.contiguous().float()
    B, T, H, _ = q.shape
    num_cmp, G = k_cmp.shape[1], k_cmp.shape[2]
    n = cfg.n_selected
    n_pad = _pow2(n)
    bm, splits, warps, tok_pad = selection_tiles(q.shape[-1], n_pad, cfg.sel_block // cfg.cmp_stride)
    bm = min(bm, _pow2(T))  # no query tile past a short sequence's rows (the interpreter's tile is 128)
    blocks = torch.empty(B, T, G, n, dtype=torch.int32, device=q.device)
    tiles = _tile_args(dict(BLOCK_M=bm, BLOCK_N=tok_pad), dict(QD=q), dict(KCD=k_cmp))
    try:
        select_blocks_kernel[(triton.cdiv(T, bm), B * G)](
            q, k_cmp, LSE=lse, BLOCKS=blocks, T=T, num_cmp=num_cmp, scale=scale, H=H, G=G, DK=q.shape[-1],
            BLOCK_DK=_pow2(q.shape[-1]),
            CMP_BLOCK=cfg.cmp_block, CMP_STRIDE=cfg.cmp_stride, SEL_BLOCK=cfg.sel_block, N_SELECT=n,
            N_INIT=cfg.n_init_blocks, N_LOCAL=cfg.n_local_blocks, BLOCK_M=bm, N_PAD=n_pad, CHUNK_SPLITS=splits,
            TOK_PAD=tok_pad, DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, **tiles)
    except triton.runtime.errors.OutOfResources as e:
        # A chunk holds at least n_pad blocks: its keys, tok_pad x head dim, are staged in shared memory whole.
        raise ValueError(f"select_blocks: a chunk of {tok_pad} compressed tokens (n = {n} blocks of "
                         f"{cfg.sel_block // cfg.cmp_stride} tokens) at head dim {q.shape[-1]} in {q.dtype} does not "
                         f"fit this GPU's shared memory ({e}); bf16 or fp16 inputs, or a smaller n or l' / d, "
                         "need less") from e
    return blocks


def select_launch(head_dim: int) -> tuple[int, int, int]:
    """(query tile, chunk splits, warps) of the selection kernel at this head dim (LaunchConfig.select*)."""
    if head_dim <= 64:
        return _config.select_d64
    return _config.select_d128 if head_dim <= 128 else _config.select


# Query rows times a chunk's compressed tokens of the selection kernel's score tile, at most, for head dims above 64.
# On the H200 under Triton 3.6 the kernel compiled at head dim 128 with a 64 x 512 tile returns wrong sets (every row
# of T = 16k and 64k, l' = 128, n = 32: 512 tokens a chunk at 32-block chunks); 64 x 256 and 32 x 512 are right, and
# so are 64 x 512 and 64 x 1024 at head dim 64 (kernels-notes.md v71). The interpreter has no such limit.
_SELECT_TILE_ELEMENTS = 64 * 256


def selection_tiles(head_dim: int, n_pad: int, pieces_per_block: int) -> tuple[int, int, int, int]:
    """(query tile, chunk splits, warps, tokens a chunk) of the selection kernel: select_launch's, with chunks
    halved, then query tiles halved (down to 16 rows), while a head dim above 64 would make the score tile larger
    than _SELECT_TILE_ELEMENTS. A chunk holds n_pad * 2^splits blocks of pieces_per_block (l' / d) tokens."""
    bm, splits, warps = select_launch(head_dim)

    def tokens(s: int) -> int:
        return _pow2((n_pad << s) * pieces_per_block)
    if head_dim > 64:
        while splits > 0 and bm * tokens(splits) > _SELECT_TILE_ELEMENTS:
            splits -= 1
        while bm > 16 and bm * tokens(splits) > _SELECT_TILE_ELEMENTS:
            bm //= 2
    return bm, splits, warps, tokens(splits)


# --- selected branch ------------------------------------------------------------------------------------------

def inverted_index(blocks: torch.Tensor, num_blocks: int):
    """(query_of_entry [E] int32, starts [B*G*num_blocks + 1] int64): the queries that chose block j of
    (batch b, group g) are query_of_entry[starts[s]:starts[s+1]] with s = (b*G + g)*num_blocks + j, ascending."""
    B, T, G, n = blocks.shape
    sorted_segment, order = _sorted_segments(blocks, num_blocks)
    query_of_entry = ((order // (G * n)) % T).to(torch.int32)
    boundaries = torch.arange(B * G * num_blocks + 1, device=blocks.device, dtype=sorted_segment.dtype)
    return query_of_entry, torch.searchsorted(sorted_segment, boundaries)


_SEGMENT_SLOTS = 1024  # slots per program of segment_ids_kernel


def _segment_ids(blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B*T*G*n]: segment s = (b*G + g)*num_blocks + block of each (b, t, g, slot) entry, S = B*G*num_blocks for an
    empty slot, one launch (kernels/block_index.py). The keys take the narrowest integer type that holds S: a
    radix sort makes one pass per key byte, so int16 keys (S < 2^15, e.g. 1024 segments at 125M 1 x 32k) take two
    passes where int64 took eight (the sort went from 0.13 to 0.04 ms at every 125M shape on the H100,
    kernels-h100-2026-11-23-v9.md)."""
    B, T, G, n = blocks.shape
    num_segments = B * G * num_blocks
    dtype = next(d for d in (torch.int16, torch.int32, torch.int64) if num_segments <= torch.iinfo(d).max)
    segment = torch.empty(blocks.numel(), dtype=dtype, device=blocks.device)
    if segment.numel():
        segment_ids_kernel[(triton.cdiv(segment.numel(), _SEGMENT_SLOTS),)](
            blocks.contiguous(), segment, segment.numel(), T, num_blocks, num_segments, G=G, N=n,
            BLOCK=_SEGMENT_SLOTS)
    return segment


def _sorted_segments(blocks: torch.Tensor, num_blocks: int):
    """(sorted segment ids, order): _segment_ids sorted stably (a block's choosers stay in query order)."""
    return torch.sort(_segment_ids(blocks, num_blocks), stable=True)


def tile_block_union(blocks: torch.Tensor, tile_q: int, num_blocks: int, shapes_only: bool = False):
    """(union [B, num_tiles, G, tile_q * n] int32, count [B, num_tiles, G] int32, members [B, num_tiles, G,
    tile_q * n] int64): for each tile of tile_q consecutive queries, the distinct blocks (ids < num_blocks) its
    queries chose, ascending in union[..., :count], padding after; members[..., i]: bit q set where the tile's
    query q chose union[..., i] (valid up to the count). shapes_only: empty tensors of those shapes (nsa::core's
    fake)."""
    B, T, G, n = blocks.shape
    if tile_q > 64:
        raise ValueError(f"tile_block_union: a tile of {tile_q} queries; its membership masks hold 64 (a smaller "
                         "LaunchConfig.slc_tile_rows, or more heads a group, makes fewer queries a tile)")
    num_tiles, width = triton.cdiv(T, tile_q), tile_q * n
    if shapes_only:
        return (blocks.new_empty(B, num_tiles, G, width, dtype=torch.int32),
                blocks.new_empty(B, num_tiles, G, dtype=torch.int32),
                blocks.new_empty(B, num_tiles, G, width, dtype=torch.int64))
    # The kernel compares each choice with every block id, T * n * num_blocks compares in all, which grows with
    # T squared; up to _UNION_KERNEL_WIDTHS times the tile's width in blocks it still beats the two sorts of each
    # tile's choices (paper 8k: 0.02 against 0.10 ms, v38; paper 32k, 8 widths: 0.30 against about 2.5 ms, and
    # 64k, 16 widths: 1.1 against about 5 ms, v53); beyond, the sorts.
    if num_blocks <= _UNION_KERNEL_WIDTHS * width:
        return _union_by_kernel(blocks, tile_q, num_blocks)
    pad = num_tiles * tile_q - T
    if pad:
        blocks = torch.cat([blocks, blocks.new_full((B, pad, G, n), -1)], dim=1)
    per_tile = blocks.view(B, num_tiles, tile_q, G, n).permute(0, 1, 3, 2, 4).reshape(B, num_tiles, G, width)
    return _union_by_sort(per_tile, n)


_UNION_KERNEL_WIDTHS = 16  # tile_block_union: the kernel up to this many times a tile's width in blocks
_ABSENT = torch.iinfo(torch.int32).max  # the union's padding: after every block id (kernels/block_index.py's)
_UNION_COMPARES = 8192  # choice x block comparisons per step of tile_union_kernel


def _union_by_kernel(blocks: torch.Tensor, tile_q: int, num_blocks: int):
    """tile_block_union in one launch: each tile's block membership and a prefix sum over the blocks, which
    places every chosen block at its rank, no sort (kernels/block_index.py). As PyTorch ops (a scatter, a cumsum,
    a second scatter, v12) it took about 15 launches per layer call."""
    B, T, G, n = blocks.shape
    num_tiles, width = triton.cdiv(T, tile_q), tile_q * n
    union = blocks.new_empty(B, num_tiles, G, width, dtype=torch.int32)
    count = blocks.new_empty(B, num_tiles, G, dtype=torch.int32)
    members = blocks.new_empty(B, num_tiles, G, width, dtype=torch.int64)
    n_pad, nb_pad = _pow2(n, floor=2), _pow2(num_blocks)
    queries = min(max(1, _UNION_COMPARES // (n_pad * nb_pad)), _pow2(tile_q, floor=1))
    if count.numel():
        tile_union_kernel[(num_tiles, B * G)](
            blocks.contiguous(), union, count, members, T, num_tiles, G=G, N=n, N_PAD=n_pad, TILE_Q=tile_q,
            QUERIES=queries, NB_PAD=nb_pad, WIDTH=width, BLOCK_W=min(_pow2(width), 1024))
    return union, count, members


def _union_by_sort(per_tile: torch.Tensor, n: int):
    """tile_block_union from two sorts of each tile's choices (per_tile [..., queries * n], query-major): the
    second moves the repeats behind the union; then each query's choices against the union, a bit a query."""
    ids = torch.where(per_tile >= 0, per_tile, _ABSENT).sort(-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    union = torch.where(repeat, _ABSENT, ids).sort(-1).values
    members = torch.zeros(union.shape, dtype=torch.int64, device=union.device)
    for q, chosen in enumerate(per_tile.split(n, dim=-1)):  # one query's n choices at a time: memory O(width * n)
        hit = (union[..., :, None] == chosen[..., None, :]) & (union != _ABSENT)[..., None]
        members |= hit.any(-1).to(torch.int64) << q
    return union.contiguous(), (union != _ABSENT).sum(-1, dtype=torch.int32), members


def _selected_tile(hpg: int) -> tuple[int, int]:
    """(rows, tile_q) of the tiled selected kernels: a program's matrix rows (slc_tile_rows, at least one query's
    heads rounded up to a power of two) and the tile_q = rows // hpg queries whose heads fill them unpadded."""
    rows = max(_config.slc_tile_rows, triton.next_power_of_2(hpg))
    return rows, rows // hpg


def selected_kernel(hpg: int, num_blocks: int, n: int, config: LaunchConfig | None = None) -> str:
    """The selected-branch variant that runs under config (auto resolved from static shapes, no host sync).

    auto (bench/results/kernels-notes.md, v6): small groups (<= slc_auto_max_hpg heads) go `by_block`, which
    fills the matrix rows with several choosers and loads each block once per slice of its choosers, whatever
    the selections look like; where a sequence has at most slc_auto_tiled_fwd_blocks * n blocks, `tiled_by_block`
    (v11: tiled's forward keeps the partial outputs on chip, by_block's backward). Large groups fill the rows per
    query already: `tiled` while a sequence has at most slc_auto_tiled_blocks * n blocks (a tile of neighbouring
    queries then shares most of its blocks), `per_query` beyond (random selections make a tile's union 3-6x n
    there)."""
    config = config or _config
    if config.slc_kernel != "auto":
        return config.slc_kernel
    if _auto_small_group(hpg, config):
        # Where a sequence has few blocks, a tile of neighbouring queries shares most of them and tiled's forward
        # keeps each query's partial outputs on chip (no partials written, no combine pass).
        return "tiled_by_block" if num_blocks <= config.slc_auto_tiled_fwd_blocks * n else "by_block"
    return "tiled" if num_blocks <= config.slc_auto_tiled_blocks * n else "per_query"


def _auto_small_group(hpg: int, config: LaunchConfig) -> bool:
    """Whether auto picks among the by_block variants (by_block, tiled_by_block: one index) for this group size."""
    return config.slc_kernel == "auto" and hpg <= config.slc_auto_max_hpg


_WORK_SEGMENTS = 1024  # segments per step of block_work_kernel


def block_work(blocks: torch.Tensor, num_blocks: int, chunk: int, shapes_only: bool = False,
               build: str | None = None):
    """The inverted index of the by_block kernels and their work list, sizes fixed by shapes.

    order [B*T*G*n] int32: flat slot ((b*T + t)*G + g)*n + i of each valid entry, sorted by segment s = (b*G + g) *
    num_blocks + block, query order inside a segment (its first starts[S] entries; the rest unused: -1 from the
    count build, the empty slots' flat slots from the sort); starts [S + 1]
    int32: segment s is order[starts[s]:starts[s+1]]; work_seg, work_chunk [W] int32: program p handles chunk
    work_chunk[p] (chunk entries) of segment work_seg[p], or nothing where work_seg[p] = -1 (W is an upper bound:
    no host sync). An empty segment has one item too, with no entries: the backward writes its block's zero dK, dV
    there. build (LaunchConfig.index_build unless given; index_build() resolves auto): "count", three kernels that
    count, sum and sort each tile of slots in registers (each (b, g) owns a part of the work list: its items, then
    its spares); "sort", the slots' segment keys sorted by PyTorch, one pass over them for the starts and one
    program for the work list (spares at the end). shapes_only: empty tensors of those shapes."""
    B, T, G, n = blocks.shape
    dev = blocks.device
    num_segments, entries = B * G * num_blocks, blocks.numel()
    if entries >= 2 ** 31:  # the kernels' int32 index arithmetic (kernels/selected_by_block.py)
        raise ValueError(f"blocks: B*T*G*n = {entries} slots exceed the by_block kernels' int32 index; use "
                         "LaunchConfig(slc_kernel='tiled') or a smaller batch")
    # One size of work list for both builds: count's, each (b, g) its own part, which is at least sort's
    # cdiv(entries, chunk) + num_segments. The sizes are then simple products of the NSA setting, as nsa::core's
    # fake must give them for a graph that does not specialize on l' and n (nsa_model.compile_model).
    work_per_group = triton.cdiv(T * n, chunk) + num_blocks
    num_work = B * G * work_per_group
    starts = torch.empty(num_segments + 1, dtype=torch.int32, device=dev)
    work_seg, work_chunk = (torch.empty(num_work, dtype=torch.int32, device=dev) for _ in range(2))
    if shapes_only:
        return torch.empty(entries, dtype=torch.int32, device=dev), starts, work_seg, work_chunk
    build = index_build(T, n, num_blocks, build or _config.index_build)
    if build == "count":
        # the entries past the valid ones are unused, -1 rather than whatever memory held: every output of nsa::core
        # is then the same on every run, as torch.library.opcheck requires of an op
        order = torch.full((entries,), -1, dtype=torch.int32, device=dev)
        _count_index(blocks.contiguous(), num_blocks, chunk, work_per_group, order, starts, work_seg, work_chunk)
        return order, starts, work_seg, work_chunk
    sorted_segment, order = _sorted_segments(blocks, num_blocks)
    segment_starts_kernel[(triton.cdiv(entries + 1, _SEGMENT_SLOTS),)](sorted_segment, starts, entries,
                                                                      num_segments, BLOCK=_SEGMENT_SLOTS)
    block_work_kernel[(1,)](starts, work_seg, work_chunk, num_segments, num_work, CHUNK=chunk,
                            BLOCK_S=_WORK_SEGMENTS)
    return order.to(torch.int32), starts, work_seg, work_chunk


_TILE_SLOTS = 1024  # slots per tile of the counting index build: one in-register sort of this many int32 keys
# auto's limit: (block, tile) counts of one (b, g) that segment_offsets_kernel sums, in _OFFSET_CELLS steps. The
# probe (v47, H100, CUDA graphs): count 41 / 51 / 34 us against sort's 68 / 73 / 54 at 125M 16 x 2k and 4 x 8k and
# paper 8k (32 x 32, 128 x 128, 128 x 128 counts); 141 against 93 at 125M 32k and 628 against 371 at paper 64k
# (512 x 512 and 1024 x 1024), where its one program a (b, g) walks 64 and 256 steps.
_COUNT_AUTO_CELLS = 16384


def index_build(T: int, n: int, num_blocks: int, build: str) -> str:
    """The build block_work runs for `build` (one of INDEX_BUILDS) at these sizes: auto resolved by the number of
    (block, tile) counts a (b, g) has."""
    if build not in INDEX_BUILDS:
        raise ValueError(f"block_work: build must be one of {INDEX_BUILDS}, got {build!r}")
    if build != "auto":
        return build
    tiles = triton.cdiv(T, _TILE_SLOTS // _pow2(n, floor=1))
    return "count" if _pow2(num_blocks, floor=1) * _pow2(tiles, floor=1) <= _COUNT_AUTO_CELLS else "sort"


_OFFSET_CELLS = 4096  # (block, tile) counts per step of segment_offsets_kernel (16384 spilled 3 KB at 4 warps)


def _count_index(blocks, num_blocks: int, chunk: int, work_per_group: int, order, starts, work_seg, work_chunk):
    """block_work's "count" build into its outputs (kernels/block_index.py): a tile is the slots of
    _TILE_SLOTS / n_pad consecutive queries of one (b, g), or of all T where they are fewer."""
    B, T, G, n = blocks.shape
    n_pad = _pow2(n, floor=1)
    if n_pad > _TILE_SLOTS or (num_blocks + 1) * _TILE_SLOTS >= 2 ** 31:
        raise ValueError(f"block_work: n = {n} slots a query and {num_blocks} blocks exceed the counting index's "
                         f"tile of {_TILE_SLOTS} slots or its int32 sort keys; use LaunchConfig(index_build='sort')")
    # A sequence whose slots all fit in fewer than _TILE_SLOTS sorts only those: one tile either way, and the
    # sort's lanes past the sequence were all invalid (in the interpreter a 1024-key sort took 2.5 s a program).
    entries = min(_TILE_SLOTS, _pow2(T, floor=1) * n_pad)
    num_tiles, groups = triton.cdiv(T, entries // n_pad), B * G
    if not groups or not T:
        starts.zero_()
        work_seg.fill_(-1)
        return
    counts = torch.empty(groups * num_blocks * num_tiles, dtype=torch.int32, device=blocks.device)
    offsets = torch.empty_like(counts)
    tile_total = torch.empty(groups * num_tiles, dtype=torch.int32, device=blocks.device)
    slots = dict(G=G, N=n, N_PAD=n_pad, ENTRIES=entries)
    tile_histogram_kernel[(num_tiles, groups)](blocks, counts, tile_total, T, num_blocks, num_tiles, **slots,
                                               NB_PAD=_pow2(num_blocks))
    nt_pad = _pow2(num_tiles, floor=1)
    segment_offsets_kernel[(groups,)](counts, tile_total, offsets, starts, work_seg, work_chunk, num_blocks,
                                      num_tiles, groups, work_per_group, CHUNK=chunk,
                                      ROWS=max(1, min(_OFFSET_CELLS // nt_pad, _pow2(num_blocks, floor=1))),
                                      NT_PAD=nt_pad, BLOCK_S=_WORK_SEGMENTS)
    tile_scatter_kernel[(num_tiles, groups)](blocks, offsets, order, T, num_blocks, num_tiles, **slots,
                                             ENTRY_BITS=entries.bit_length() - 1)


def _block_rows(hpg: int, config: LaunchConfig) -> int:
    return max(config.slc_block_rows, triton.next_power_of_2(hpg))  # at least one chooser per step


def _partial_dtype(x: torch.Tensor, config: LaunchConfig) -> torch.dtype:
    return torch.float32 if config.slc_partial == "fp32" else x.dtype


_COMBINE_ROWS = 32  # (b, t, h) rows per program of the combine and dQ-sum kernels
_INT32_SPAN = 2 ** 31 - 2 ** 16  # int32 offsets, with room for a tile's padded columns past a tensor's end


def _offsets_64(*tensors: torch.Tensor) -> bool:
    """Whether a kernel's element offsets into these tensors need int64 (OFFSETS_64 of the by_block kernels): some
    tensor spans more elements than _INT32_SPAN, counted by its strides from its first element to its last."""
    return any(1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) > _INT32_SPAN for x in tensors)


def _check_scale(scale: float) -> None:
    """The forward kernels (range, tiled, by_block) take a row's maximum score before scaling it (an FMA an
    element) and by_block's backward takes log2(scale) (kernels-notes.md v42, v43): right only for a positive
    scale. Any selected variant may run by_block's backward, so the selected branch's forward refuses any other
    scale before it starts, and so does every range forward."""
    if not scale > 0:
        raise ValueError(f"scale: the triton backend takes a positive softmax scale, got {scale}")


def _selected_common(q, k, v, sel_block: int, n: int) -> dict:
    """The shape and layout arguments every selected-branch kernel takes (k, v as _kv_rows gives them)."""
    H, G = q.shape[2], k.shape[2]
    return dict(H=H, G=G, SEL_BLOCK=sel_block, BLOCK_S=_pow2(sel_block), N_SELECT=n, **_head_dims(q, v),
                **_kv_strides(k, v))


def _selected_fwd(q, k, v, blocks, sel_block: int, scale: float):
    """(o, lse, kernel, index) of the selected branch: the variant that ran and the index its backward reuses."""
    _check_scale(scale)
    q, k, v, blocks = q.contiguous(), _kv_rows(k), _kv_rows(v), blocks.contiguous()
    B, T, H, _ = q.shape
    G, n = k.shape[2], blocks.shape[-1]
    o = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    common = _selected_common(q, k, v, sel_block, n)
    kernel = selected_kernel(H // G, triton.cdiv(T, sel_block), n)
    index = _selected_index(blocks, sel_block, kernel, H // G)
    if kernel == "by_block":
        _selected_by_block_fwd(q, k, v, blocks, o, lse, index, common, scale)
    elif kernel in ("tiled", "tiled_by_block"):
        # tiled_by_block saves by_block's work list for its backward; the unions serve the forward alone
        _tiled_fwd(q, k, v, index if kernel == "tiled" else _tile_unions(blocks, sel_block, common), o, lse, common,
                   scale)
    else:
        _per_query_fwd(q, k, v, blocks, o, lse, common, scale)
    return o, lse, kernel, index


def _per_query_fwd(q, k, v, blocks, o, lse, common: dict, scale: float, gated: dict | None = None) -> None:
    """per_query's forward into o, lse; gated: also the gated output in its epilogue (as _tiled_fwd)."""
    B, T = q.shape[:2]
    hpg = common["H"] // common["G"]
    selected_attn_fwd_kernel[(T, B * common["G"])](
        q, k, v, BLOCKS=blocks, O=o, LSE=lse, T=T, scale=scale, HEADS_PAD=_pow2(hpg), **common, **_slc_launch(),
        **_block_tiles(_pow2(hpg), common, k, v), **(dict(gated, GATED=True) if gated else {}))


def _tile_unions(blocks: torch.Tensor, sel_block: int, common: dict) -> tuple[torch.Tensor, ...]:
    """tile_block_union of blocks for the tiled forward's tiles (what tiled_by_block's forward walks)."""
    return tile_block_union(blocks, _selected_tile(common["H"] // common["G"])[1],
                            triton.cdiv(blocks.shape[1], sel_block))


def _tiled_fwd(q, k, v, union_index: tuple, o, lse, common: dict, scale: float, gated: dict | None = None) -> None:
    """tiled's forward into o, lse over tile_block_union's (union, count, members); gated: also the gated output
    in its epilogue (selected_tiled_fwd_kernel's GATES, O_CMP, O_WIN, O_GATED)."""
    union, count, members = union_index[:3]
    B, T = q.shape[:2]
    rows, tile_q = _selected_tile(common["H"] // common["G"])
    selected_tiled_fwd_kernel[(union.shape[1], B * common["G"])](
        q, k, v, UNION=union, COUNT=count, MEMBERS=members, O=o, LSE=lse, T=T, num_tiles=union.shape[1],
        scale=scale, ROWS=rows, TILE_Q=tile_q, WIDTH_PAD=triton.next_power_of_2(tile_q * common["N_SELECT"]),
        **common, num_warps=_config.slc_tile_warps, num_stages=_tiled_fwd_stages(q, v),
        **_block_tiles(rows, common, k, v), **(dict(gated, GATED=True) if gated else {}))


def _tiled_fwd_stages(q: torch.Tensor, v: torch.Tensor) -> int:
    """Pipeline stages of the tiled forward (its dQ keeps slc_tile_stages)."""
    return _config.slc_tile_stages if max(q.shape[-1], v.shape[-1]) <= 64 else _config.slc_tile_fwd_stages_d128


def _block_prefetch(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the by_block kernels load each step's chooser rows a step ahead, into registers (PREFETCH in
    kernels/selected_by_block.py). At head dim 64 that took 7-12% off both kernels on the H100 (v24); at 128 the
    prefetched tiles do not fit: the backward at paper 8k went from 1.43 to 2.27 ms."""
    return max(q.shape[-1], v.shape[-1]) <= _config.slc_block_prefetch_dims


def _block_tiles(rows: int, common: dict, k: torch.Tensor, v: torch.Tensor) -> dict:
    """The key-block tile arguments of the selected kernels (TMA and descriptors, or not: _tile_args)."""
    return _tile_args(dict(BLOCK_M=rows, BLOCK_N=common["BLOCK_S"]), {}, dict(KD=k, VD=v))


def _selected_index(blocks, sel_block: int, kernel: str, hpg: int,
                    shapes_only: bool = False) -> tuple[torch.Tensor, ...]:
    """What the selected variant's forward and backward read besides the selections: by_block's work list,
    tiled's block unions. shapes_only: empty tensors of their shapes (nsa::core's fake)."""
    if kernel in BY_BLOCK_BACKWARD:
        return _by_block_index(blocks, sel_block, _config, shapes_only)
    if kernel == "tiled":
        return tile_block_union(blocks, _selected_tile(hpg)[1], triton.cdiv(blocks.shape[1], sel_block),
                                shapes_only)
    return ()


def _selected_bwd(q, k, v, blocks, o, lse, index, do, sel_block: int, scale: float, kernel: str, delta=None,
                  dq_add=None, dq_slots: bool = False):
    """(dq, dk, dv) of _selected_fwd, under the launch config its forward ran with (the caller pins it); index
    is the forward's (_selected_index), possibly followed by unused empty slots; delta as in _range_bwd;
    dq_add: one or two [B,T,H,Dk] tensors added into dq (folded into by_block's dQ slot sum; the query-driven
    dQ kernels add the first in place, so it must be the caller's own scratch, and it is returned as dq).
    dq_slots (by_block backward with dQ slots): dq is by_block's per-slot contributions, for the caller's range
    dQ kernel to sum (slc_slot_sum = "range_dq")."""
    q, k, v, blocks, do = q.contiguous(), _kv_rows(k), _kv_rows(v), blocks.contiguous(), do.contiguous()
    B, T, H, _ = q.shape
    G, n = k.shape[2], blocks.shape[-1]
    hpg, config = H // G, _config
    delta = _delta(do, o) if delta is None else delta
    common = _selected_common(q, k, v, sel_block, n)
    if kernel in BY_BLOCK_BACKWARD:
        dq, dk, dv = _selected_by_block_bwd(q, k, v, blocks, do, lse, delta, tuple(index[:4]), common, scale,
                                            dq_add=dq_add, dq_slots=dq_slots)
        return dq, dk, dv
    # The first of the other branches' dQ becomes dq: the kernel adds into it (ACCUMULATE), no pass after.
    adds = list(dq_add or ())
    accumulate = bool(adds)
    dq = _dq_scratch(adds.pop(0), q) if adds else torch.empty_like(q)
    if config.slc_query_dq == "ds":
        ds, dk, dv = _selected_by_block_bwd(q, k, v, blocks, do, lse, delta, _by_block_index(blocks, sel_block, config),
                                            common, scale, dq_mode=3)
        if kernel == "tiled":
            _tiled_dq_from_ds(k, index, blocks, ds, dq, common, accumulate)
        else:
            selected_dq_from_ds_kernel[(T, B * G)](
                k, BLOCKS=blocks, DS=ds, DQ=dq, T=T, K_ROW=k.stride(1), H=H, G=G, DK=common["DK"],
                BLOCK_DK=common["BLOCK_DK"], SEL_BLOCK=sel_block, BLOCK_S=common["BLOCK_S"], N_SELECT=n,
                HEADS_PAD=_pow2(hpg), DOT_PRECISION=common["DOT_PRECISION"], ACCUMULATE=accumulate, **_slc_launch(),
                **_tile_args(dict(BLOCK_M=_pow2(hpg), BLOCK_N=common["BLOCK_S"]), {}, dict(KD=k)))
        for extra in adds:
            dq = dq.add_(extra)
        return dq, dk, dv
    if kernel == "tiled":
        union, count, members = index[:3]
        rows, tile_q = _selected_tile(hpg)
        selected_tiled_bwd_dq_kernel[(union.shape[1], B * G)](
            q, k, v, UNION=union, COUNT=count, MEMBERS=members, DO=do, LSE=lse, DELTA=delta, DQ=dq, T=T,
            num_tiles=union.shape[1], scale=scale, ROWS=rows, TILE_Q=tile_q,
            WIDTH_PAD=triton.next_power_of_2(tile_q * n), **common, num_warps=config.slc_tile_warps,
            num_stages=config.slc_tile_stages, ACCUMULATE=accumulate, **_block_tiles(rows, common, k, v))
    else:
        selected_attn_bwd_dq_kernel[(T, B * G)](
            q, k, v, BLOCKS=blocks, DO=do, LSE=lse, DELTA=delta, DQ=dq, T=T, scale=scale, HEADS_PAD=_pow2(hpg),
            ACCUMULATE=accumulate, **common, **_slc_launch(), **_block_tiles(_pow2(hpg), common, k, v))
    if config.slc_dkdv == "by_block":
        block_index = _by_block_index(blocks, sel_block, config)
        _, dk, dv = _selected_by_block_bwd(q, k, v, blocks, do, lse, delta, block_index, common, scale, dq_mode=0)
    else:
        dk, dv = _selected_dkdv(q, k, v, do, lse, delta, blocks, sel_block, scale)
    for extra in adds:
        dq = dq.add_(extra)
    return dq, dk, dv


def _tiled_dq_from_ds(k, union_index: tuple, blocks, ds, dq, common: dict, accumulate: bool) -> None:
    """dq of the tiled variant from by_block's stored ds (slc_query_dq = "ds"): per tile, the union's keys times
    its member rows' ds; with accumulate, added to what dq holds."""
    union, count, members = union_index[:3]
    B, T = blocks.shape[:2]
    G, n = common["G"], common["N_SELECT"]
    rows, tile_q = _selected_tile(common["H"] // G)
    selected_tiled_dq_from_ds_kernel[(union.shape[1], B * G)](
        k, UNION=union, COUNT=count, MEMBERS=members, BLOCKS=blocks, DS=ds, DQ=dq, T=T, num_tiles=union.shape[1],
        K_ROW=k.stride(1), H=common["H"], G=G, DK=common["DK"], BLOCK_DK=common["BLOCK_DK"],
        SEL_BLOCK=common["SEL_BLOCK"], BLOCK_S=common["BLOCK_S"], N_SELECT=n, N_PAD=triton.next_power_of_2(n),
        ROWS=rows, TILE_Q=tile_q, DOT_PRECISION=common["DOT_PRECISION"], ACCUMULATE=accumulate,
        num_warps=_config.slc_ds_warps, num_stages=_config.slc_ds_stages,
        **_tile_args(dict(BLOCK_M=rows, BLOCK_N=common["BLOCK_S"]), {}, dict(KD=k)))


def _dq_scratch(dq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """dq, another branch's dQ, as the tensor a dQ kernel adds into: q's shape, dtype and contiguous layout."""
    if dq.shape != q.shape or dq.dtype != q.dtype or not dq.is_contiguous():
        raise ValueError(f"dq_add: expected a contiguous {q.dtype} {tuple(q.shape)} tensor to add into, got "
                         f"{dq.dtype} {tuple(dq.shape)} strides {dq.stride()}")
    return dq


class _SelectedAttention(torch.autograd.Function):
    """The selected branch on its own (the whole core is the nsa::core op below)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, sel_block: int, scale: float):
        o, lse, kernel, index = _selected_fwd(q, k, v, blocks, sel_block, scale)
        ctx.save_for_backward(q, k, v, blocks, o, lse, *index)
        ctx.params = (sel_block, scale, _config, kernel)  # backward uses the forward's variant and tile
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, blocks, o, lse, *index = ctx.saved_tensors
        sel_block, scale, config, kernel = ctx.params
        with use_launch_config(config):
            dq, dk, dv = _selected_bwd(q, k, v, blocks, o, lse, index, do, sel_block, scale, kernel)
        return dq, dk, dv, None, None, None


def _selected_by_block_fwd(q, k, v, blocks, o, lse, index, common, scale):
    """Forward of the by_block variant into o and lse, over the work list `index` (_by_block_index): the partials,
    then the combine pass."""
    o_part, lse2_part = _selected_by_block_partials(q, k, v, index, common, scale)
    _combine_partials(o_part, lse2_part, blocks, o, lse, common)


def _combine_partials(o_part, lse2_part, blocks, o, lse, common, gated: dict | None = None) -> None:
    """o, lse [B, T, H, (Dv)] of by_block's forward from its partials (one pass). gated: also the gated output, in
    the same pass (selected_combine_kernel's GATES, O_CMP, O_WIN, O_GATED)."""
    rows = lse.numel()  # (b, t, h)
    selected_combine_kernel[(triton.cdiv(rows, _COMBINE_ROWS),)](
        o_part, lse2_part, blocks, o, lse, rows, H=common["H"], G=common["G"], DV=common["DV"],
        BLOCK_DV=common["BLOCK_DV"], N_SELECT=common["N_SELECT"], BLOCK_R=_COMBINE_ROWS,
        **(dict(gated, GATED=True) if gated else {}))


def _selected_by_block_partials(q, k, v, index, common, scale):
    """(o_part [B*T*G*n*hpg, Dv], lse2_part [B*T*G*n*hpg] fp32): by_block's forward, each chooser's result over its
    slot's block (kernels/selected_by_block.py), for a combine to merge."""
    B, T, H, _ = q.shape
    G, dv = k.shape[2], v.shape[-1]
    hpg, c = H // G, _config
    num_blocks = triton.cdiv(T, common["SEL_BLOCK"])
    order, starts, work_seg, work_chunk = index
    slots = B * T * G * common["N_SELECT"] * hpg
    o_part = torch.empty(slots, dv, dtype=_partial_dtype(q, c), device=q.device)
    lse2_part = torch.empty(slots, dtype=torch.float32, device=q.device)
    prefetch = _block_prefetch(q, v)
    selected_block_fwd_kernel[(work_seg.numel(),)](
        q, k, v, ORDER=order, STARTS=starts, WORK_SEG=work_seg, WORK_CHUNK=work_chunk, O_PART=o_part,
        LSE2_PART=lse2_part, T=T, num_blocks=num_blocks, scale=scale, ROWS=_block_rows(hpg, c),
        CHUNK=c.slc_block_chunk, PREFETCH=prefetch, OFFSETS_64=_offsets_64(q, k, v, o_part), **common,
        num_warps=c.slc_block_warps, num_stages=c.slc_block_stages,
        **(dict(maxnreg=c.slc_block_fwd_maxnreg) if prefetch else {}),
        **_block_tiles(_block_rows(hpg, c), common, k, v))
    return o_part, lse2_part


def _by_block_index(blocks, sel_block, config, shapes_only: bool = False):
    return block_work(blocks, triton.cdiv(blocks.shape[1], sel_block), config.slc_block_chunk, shapes_only)


def _selected_by_block_bwd(q, k, v, blocks, do, lse, delta, index, common, scale, dq_mode=None, dq_add=None,
                           dq_slots=False):
    """(dq or None, dk, dv) of the selected branch by key blocks: one fused kernel over the blocks' choosers, then
    the dQ slot sum. dk and dv: the gradients in k's and v's dtype, written by the kernel itself. dq_mode 0
    computes dK/dV only (for the query-driven variants); 3 also stores ds, returned in dq's place as
    [B*T*G*n*hpg, BLOCK_S] rows (for the query-driven dQ from ds, _selected_bwd); None follows slc_dq. dq_add: one
    or two [B,T,H,Dk] tensors added into dq (the other branches' dQ), by the slot sum where it runs. dq_slots (with
    dQ slots): no slot sum; dq is the slots' rows [B*T*G*n*hpg, Dk] as the kernel wrote them."""
    order, starts, work_seg, work_chunk = index
    B, T, H, dk_dim = q.shape
    G, n = k.shape[2], blocks.shape[-1]
    hpg, c = H // G, _config
    num_blocks = triton.cdiv(T, common["SEL_BLOCK"])
    if dq_mode is None:
        dq_mode = 2 if c.slc_dq == "atomic" else 1
    num_segments = starts.numel() - 1
    # the accumulators where slices of one block meet, and each segment's count of finished programs: one fill
    flat = torch.zeros(k.numel() + v.numel() + num_segments, dtype=torch.float32, device=k.device)
    dk_acc, dv_acc = flat[:k.numel()].view(k.shape), flat[k.numel():k.numel() + v.numel()].view(v.shape)
    done = flat[k.numel() + v.numel():].view(torch.int32)
    dk_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # contiguous, whatever k's layout
    dv_out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if dq_mode == 2:  # the atomics add into the other branches' dQ, summed in float32 (no zero fill, no add after)
        dq_out = (dq_add[0].to(torch.float32, copy=True) if dq_add else
                  torch.zeros(q.shape, dtype=torch.float32, device=q.device))
        for extra in (dq_add or ())[1:]:
            dq_out += extra
        dq_add = None
    elif dq_mode == 1:
        dq_out = torch.empty(B * T * G * n * hpg, dk_dim, dtype=_partial_dtype(q, c), device=q.device)
    elif dq_mode == 3:  # ds in q's dtype, as the kernel rounds it for its dK product
        dq_out = torch.empty(B * T * G * n * hpg, common["BLOCK_S"], dtype=q.dtype, device=q.device)
    else:
        dq_out = dk_acc  # not touched
    selected_block_bwd_kernel[(work_seg.numel(),)](
        q, k, v, DO=do, LSE=lse, DELTA=delta, ORDER=order, STARTS=starts, WORK_SEG=work_seg, WORK_CHUNK=work_chunk,
        DK_ACC=dk_acc, DV_ACC=dv_acc, DQ_OUT=dq_out, DK_OUT=dk_out, DV_OUT=dv_out, DONE=done, T=T,
        num_blocks=num_blocks, scale=scale, ROWS=_block_rows(hpg, c), CHUNK=c.slc_block_chunk, DQ_MODE=dq_mode,
        PREFETCH=_block_prefetch(q, v),
        OFFSETS_64=_offsets_64(q, k, v, do, dk_acc, dv_acc, dq_out, dk_out, dv_out), **common,
        num_warps=c.slc_block_warps,
        num_stages=c.slc_block_stages,
        **_block_tiles(_block_rows(hpg, c), common, k, v))
    dq = None
    if dq_mode == 3:
        return dq_out, dk_out, dv_out
    if dq_mode == 2:
        dq = dq_out.to(q.dtype)
    elif dq_mode == 1 and dq_slots:
        if dq_add:
            raise ValueError("dq_slots: the caller sums the slots and adds the other branches' dQ itself")
        return dq_out, dk_out, dv_out
    elif dq_mode == 1:
        dq = torch.empty_like(q)
        rows = B * T * H
        adds = list(dq_add or ())
        add_a, add_b = (adds + [dq, dq])[:2]  # the kernel reads the first len(adds)
        selected_dq_sum_kernel[(triton.cdiv(rows, _COMBINE_ROWS),)](
            dq_out, blocks, dq, add_a.contiguous(), add_b.contiguous(), rows, H=H, G=G, DK=dk_dim,
            BLOCK_DK=common["BLOCK_DK"], N_SELECT=n, BLOCK_R=_COMBINE_ROWS, NUM_ADD=len(adds))
        dq_add = None  # folded in
    if dq is not None:
        for extra in dq_add or ():
            dq = dq.add_(extra)
    return dq, dk_out, dv_out


def _selected_dkdv(q, k, v, do, lse, delta, blocks, sel_block, scale):
    """dK, dV of the selected branch in k's and v's dtype: one program per key block over its choosers (inverted
    index), adding into float32 accumulators that are cast once at the end."""
    B, T, H, _ = q.shape
    G = k.shape[2]
    hpg = H // G
    dims = _head_dims(q, v)
    num_blocks = triton.cdiv(T, sel_block)
    query_of_entry, starts = inverted_index(blocks, num_blocks)
    heads_pad = triton.next_power_of_2(hpg)
    rows = max(_config.dkdv_rows, heads_pad)
    entries = rows // heads_pad
    chunk = triton.cdiv(_config.dkdv_chunk, entries) * entries
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    selected_attn_bwd_dkdv_kernel[(num_blocks, B * G, triton.cdiv(T, chunk))](
        q, k, v, do, lse, delta, query_of_entry, starts, dk_acc, dv_acc, T, num_blocks, scale, H=H, G=G,
        SEL_BLOCK=sel_block, BLOCK_S=_pow2(sel_block), HEADS_PAD=heads_pad, ENTRIES=entries, CHUNK=chunk,
        **dims, **_kv_strides(k, v), num_warps=_config.dkdv_warps)
    return dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def selected_attention(q, k, v, blocks, cfg: NSAConfig, scale: float):
    """Each query attends to the positions u <= t whose block is among its group's selected blocks."""
    _check_inputs(q=q, k=k, v=v)
    if blocks.dtype != torch.int32 or tuple(blocks.shape[:3]) != (q.shape[0], q.shape[1], k.shape[2]):
        raise ValueError(f"blocks: expected int32 [B, T, G, n] = [{q.shape[0]}, {q.shape[1]}, {k.shape[2]}, n], "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    parts, part = _attended_blocks(_visible_blocks(blocks, cfg.sel_block), cfg.sel_block)
    return _SelectedAttention.apply(q, k, v, parts, part, scale)


def _visible_blocks(blocks: torch.Tensor, sel_block: int) -> torch.Tensor:
    """blocks with every id whose block starts after its query (an id past the sequence among them) set to -1.
    Such a block holds no key its query sees (keys u <= t), so the result is the same function; and by_block's
    forward needs it: it takes a block's choosers to start with its own queries, the only ones that see part of
    it (its masked steps, kernels/selected_by_block.py), and a segment id past the sequence's blocks would land in
    the next (b, g)'s. The selection never picks such a block, so nsa::core needs no pass; blocks given to
    selected_attention may hold them."""
    t = torch.arange(blocks.shape[1], device=blocks.device, dtype=blocks.dtype).view(1, -1, 1, 1)
    return torch.where(blocks * sel_block <= t, blocks, -1)


# The selected kernels' largest key block. A larger selection block l' is attended as f equal parts of at most this
# many keys: selection block j is parts j f .. j f + f - 1 of l' / f keys, and a query attends the parts of its n
# blocks, n f of them. The keys a query attends are the same, so is the function; only the kernels' tiles change.
# v71 (H200): by_block's backward at 128-key blocks took 2.4-2.8x the time a selected key of 64-key blocks
# (its dK/dV accumulators hold the whole block), 41.5 against 14.6 ms at paper 64k, n l' = 1024.
_SLC_ATTEND_BLOCK = 64


def attend_geometry(sel_block: int, n: int) -> tuple[int, int]:
    """(keys a part, parts a query) the selected kernels attend for selection blocks of sel_block keys, n a query:
    the fewest equal parts of at most _SLC_ATTEND_BLOCK keys (l' itself where it is no larger)."""
    parts = -(-sel_block // _SLC_ATTEND_BLOCK)
    while sel_block % parts:
        parts += 1
    return sel_block // parts, n * parts


def attended_kernel(hpg: int, T: int, sel_block: int, n: int, config: LaunchConfig | None = None) -> str:
    """selected_kernel for what the selected kernels attend of n selection blocks of sel_block keys a query over T
    positions: attend_geometry's parts."""
    part, count = attend_geometry(sel_block, n)
    return selected_kernel(hpg, triton.cdiv(T, part), count, config)


def _attended_blocks(blocks: torch.Tensor, sel_block: int) -> tuple[torch.Tensor, int]:
    """(part ids [B, T, G, n f], keys a part) of selected blocks [B, T, G, n] (attend_geometry): block j gives parts
    j f .. j f + f - 1, -1 gives -1, and a part that starts after its query is -1 (_visible_blocks). The blocks
    themselves where l' needs no parts."""
    part, _ = attend_geometry(sel_block, blocks.shape[-1])
    f = sel_block // part
    if f == 1:
        return blocks, sel_block
    offsets = torch.arange(f, device=blocks.device, dtype=blocks.dtype)
    parts = torch.where(blocks[..., None] >= 0, blocks[..., None] * f + offsets, -1).flatten(-2)
    return _visible_blocks(parts, part), part


# --- gated combination ----------------------------------------------------------------------------------------

_GATE_ROWS = 32  # (b, t, h) rows per program of the gate kernels


def _gated_fwd(gates, o_cmp, o_slc, o_win):
    """o = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win (kernels/gates.py)."""
    if _config.gate_kernel == "torch":
        return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win
    gates, o_cmp, o_slc, o_win = (x.contiguous() for x in (gates, o_cmp, o_slc, o_win))
    dv = o_cmp.shape[-1]
    rows = o_cmp.numel() // dv if dv else 0
    o = torch.empty_like(o_cmp)
    if rows:
        gated_sum_fwd_kernel[(triton.cdiv(rows, _GATE_ROWS),)](
            gates, o_cmp, o_slc, o_win, o, rows, DV=dv, BLOCK_R=_GATE_ROWS, BLOCK_D=_pow2(dv))
    return o


def _gated_bwd(gates, o_cmp, o_slc, o_win, do, dgates_dtype=None, with_delta=False, lse=None):
    """(dgates, d_cmp, d_slc, d_win) of _gated_fwd; dgates in dgates_dtype (default: the gates' dtype). With
    with_delta (gate_kernel "torch"; the fused kernel gives row terms only in the folded form below), a fifth
    item: each branch's backward row term rowsum(d_i * o_i), [3, B, T, H] fp32 (cmp, slc, win), summed from d_i
    as returned (rounded to its dtype), since the attention backward computes dP from that d_i and the two must
    cancel exactly where softmax has one key (there the true dQ and dK are zero).
    lse = the three branches' log-sum-exps (fused kernel only): the d_i are not formed at all, and the result is
    (dgates, delta, lse_g), both [3, B, T, H] fp32, delta = rowsum(do * o_i) and lse_g = lse_i - ln g_i. Each
    branch's backward run on do with lse_g is then its backward of d_i (kernels/gates.py), with no gate work."""
    dgates_dtype = dgates_dtype or gates.dtype
    if _config.gate_kernel == "torch":
        if lse is not None:
            raise ValueError("_gated_bwd: the gates go into the branches' lse only with gate_kernel='fused'")
        outs = (o_cmp, o_slc, o_win)
        dgates = torch.stack([(do.float() * x.float()).sum(-1) for x in outs], dim=-1).to(dgates_dtype)
        grads = tuple(gates[..., i:i + 1] * do for i in range(3))
        if not with_delta:
            return (dgates, *grads)
        return (dgates, *grads, torch.stack([(d.float() * x.float()).sum(-1) for d, x in zip(grads, outs)]))
    fold = lse is not None
    if with_delta and not fold:
        raise ValueError("_gated_bwd: the fused kernel gives the row terms only with lse (the gates folded in)")
    gates, o_cmp, o_slc, o_win, do = (x.contiguous() for x in (gates, o_cmp, o_slc, o_win, do))
    dv = o_cmp.shape[-1]
    rows = o_cmp.numel() // dv if dv else 0
    dgates = torch.empty(gates.shape, dtype=dgates_dtype, device=gates.device)  # the kernel sums in fp32
    # folded, the three are not stored: they only give the kernel the gradients' dtype, and do stands in for them
    d_cmp, d_slc, d_win = (do, do, do) if fold else (torch.empty_like(o_cmp) for _ in range(3))
    rows_shape = (3, *o_cmp.shape[:-1])
    if fold:
        delta, lse_g = (torch.empty(rows_shape, dtype=torch.float32, device=o_cmp.device) for _ in range(2))
        lse_in = [x.contiguous() for x in lse]
    else:  # unread
        delta, lse_g, lse_in = dgates, dgates, (dgates, dgates, dgates)
    if rows:
        gated_sum_bwd_kernel[(triton.cdiv(rows, _GATE_ROWS),)](
            gates, o_cmp, o_slc, o_win, do, dgates, d_cmp, d_slc, d_win, delta, *lse_in, lse_g, rows, DV=dv,
            BLOCK_R=_GATE_ROWS, BLOCK_D=_pow2(dv), FOLD=fold)
    elif fold:  # Dv = 0: every row sum is empty, and the branches have no gradient for the lse to scale
        delta.zero_()
        lse_g.copy_(torch.stack(lse))
    return (dgates, delta, lse_g) if fold else (dgates, d_cmp, d_slc, d_win)


class _GatedSum(torch.autograd.Function):
    """The fused gated combination on its own (the whole core is the nsa::core op below)."""

    @staticmethod
    def forward(ctx, gates, o_cmp, o_slc, o_win):
        ctx.save_for_backward(gates, o_cmp, o_slc, o_win)
        return _gated_fwd(gates, o_cmp, o_slc, o_win)

    @staticmethod
    def backward(ctx, do):
        return _gated_bwd(*ctx.saved_tensors, do)


def gated_sum(gates, o_cmp, o_slc, o_win):
    """The gated combination of the three branch outputs [B,T,H,Dv] with gates [B,T,H,3]."""
    if gates.shape != (*o_cmp.shape[:3], 3) or not o_cmp.shape == o_slc.shape == o_win.shape:
        raise ValueError(f"gated_sum: expected gates [B,T,H,3] and three equal [B,T,H,Dv] outputs, got gates "
                         f"{tuple(gates.shape)}, outputs {tuple(o_cmp.shape)}, {tuple(o_slc.shape)}, "
                         f"{tuple(o_win.shape)}")
    if _config.gate_kernel == "fused":
        return _GatedSum.apply(gates, o_cmp, o_slc, o_win)
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win


# --- the whole thing: one custom op, so torch.compile traces a model through it ------------------------------
#
# nsa::core runs the four pieces above and returns, besides o and the selections, what its backward reads
# (branch outputs, log-sum-exps, the selected variant's index: always 4 slots, empty where unused). To
# torch.compile it is one opaque op with a fake implementation for shapes, so a model compiles in one graph
# per forward with no break at the core; nsa::core_bwd is its backward, opaque the same way.

_INDEX_SLOTS = 4


class _Beside:
    """Launches of one branch that need nothing from the selected branch's kernels, run beside them.

    The attention kernels are latency-bound with two or three programs per multiprocessor, and the combine and
    the dQ slot sum are bound by DRAM (kernels-notes.md, v22): one queue leaves the tail of every kernel and the
    memory passes' idle matrix units unused. With side_stream the work starts at once on a second CUDA stream,
    ordered after what the current stream has queued (v26: about 0.1 ms of 3.74 at 125m 4 x 8k); join() makes the
    current stream wait for it. Without side_stream, or off CUDA, join() runs it there, in order.

    The work writes into tensors the caller allocated on the current stream, so nothing the second stream
    allocates outlives the work: its own temporaries go back to its pool in its own order, and no tensor needs
    record_stream. Inside a CUDA graph capture the two streams become two branches of the graph."""

    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, device: torch.device, work) -> None:
        self.work, self.stream = work, None
        if _config.side_stream and device.type == "cuda":
            main = torch.cuda.current_stream(device)
            if device.index not in self._streams:
                self._streams[device.index] = torch.cuda.Stream(device)
            self.stream = self._streams[device.index]
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                work()

    def join(self) -> None:
        if self.stream is None:
            self.work()
        else:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


def _empty_index(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=device)


def _padded_index(index: tuple, device) -> list[torch.Tensor]:
    return [*index, *(_empty_index(device) for _ in range(_INDEX_SLOTS - len(index)))]


def _core_nsa_config(cmp_block, cmp_stride, sel_block, n_selected, window, n_init_blocks, n_local_blocks):
    return NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block, n_selected=n_selected,
                     window=window, n_init_blocks=n_init_blocks, n_local_blocks=n_local_blocks)


@torch.library.custom_op("nsa::core", mutates_args=())
def _core(q: torch.Tensor, k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
          k_cmp: torch.Tensor, v_cmp: torch.Tensor, gates: torch.Tensor, cmp_block: int, cmp_stride: int,
          sel_block: int, n_selected: int, window: int, n_init_blocks: int, n_local_blocks: int,
          scale: float, recompute: bool) -> list[torch.Tensor]:
    """[o, blocks, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, *index (4 slots)]. With recompute, o_cmp and
    o_win are empty: nsa::core_bwd computes them again (_recomputed_ranges)."""
    cfg = _core_nsa_config(cmp_block, cmp_stride, sel_block, n_selected, window, n_init_blocks, n_local_blocks)
    T = q.shape[1]
    q = q.contiguous()
    (o_cmp, lse_cmp), (o_win, lse_win), win = _range_forwards(q, k_win, v_win, k_cmp, v_cmp, cmp_block, cmp_stride,
                                                              window, scale)
    blocks = select_blocks(q, k_cmp, lse_cmp, cfg, scale)
    parts, part = _attended_blocks(blocks, sel_block)  # the backward makes the same parts from blocks
    kernel = attended_kernel(q.shape[2] // k_slc.shape[2], T, sel_block, n_selected)
    if _gates_in_selected_fwd():
        o, o_slc, lse_slc, index = _selected_gated_fwd(q, k_slc, v_slc, parts, part, scale, gates, o_cmp, o_win,
                                                       win, kernel)
    else:
        o_slc, lse_slc, _, index = _selected_fwd(q, k_slc, v_slc, parts, part, scale)
        win.join()
        o = _gated_fwd(gates, o_cmp, o_slc, o_win)
    if recompute:
        o_cmp, o_win = _empty_range_output(q), _empty_range_output(q)
    return [o, blocks, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, *_padded_index(index, q.device)]


@_core.register_fake
def _core_fake(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cmp_block, cmp_stride, sel_block, n_selected,
               window, n_init_blocks, n_local_blocks, scale, recompute):
    B, T, H, _ = q.shape
    G, dv = k_slc.shape[2], v_slc.shape[-1]
    out = q.new_empty(B, T, H, dv)
    lse = q.new_empty(B, T, H, dtype=torch.float32)
    blocks = q.new_empty(B, T, G, n_selected, dtype=torch.int32)
    part, count = attend_geometry(sel_block, n_selected)
    kernel = _index_variant(H // G, T, sel_block, n_selected)
    index = _selected_index(blocks.new_empty(B, T, G, count), part, kernel, H // G, shapes_only=True)
    o_range = (lambda: _empty_range_output(q)) if recompute else (lambda: out.new_empty(out.shape))
    return [out, blocks, o_range(), lse, out.new_empty(out.shape), lse.new_empty(lse.shape), o_range(),
            lse.new_empty(lse.shape), *_padded_index(index, q.device)]


def _index_variant(hpg: int, T: int, sel_block: int, n: int) -> str:
    """A selected variant whose index (_selected_index) has the shapes of attended_kernel's, decided from as little of
    the NSA setting as that takes. Under torch.compile with l' and n symbolic (nsa_model.compile_model) each
    comparison of them here becomes a guard of the traced graph: the by_block variants share one index, so small
    groups compare neither; only large groups choose between tiled's index and per_query's none."""
    if _auto_small_group(hpg, _config):
        return "by_block"
    return attended_kernel(hpg, T, sel_block, n)


def _gates_in_selected_fwd() -> bool:
    """Whether nsa::core's forward sums the gated output in the selected branch's last forward pass
    (slc_combine = "gated"): by_block's combine pass, or the epilogue of the tiled (tiled_by_block's too) or
    per-query forward; where the gates are the fused kernel's."""
    return _config.slc_combine == "gated" and _config.gate_kernel == "fused"


def _selected_gated_fwd(q, k, v, blocks, sel_block: int, scale: float, gates, o_cmp, o_win, win: _Beside,
                        kernel: str):
    """(o, o_slc, lse_slc, index) of nsa::core's forward under _gates_in_selected_fwd. by_block: its partials,
    then, once the window forward (win) has finished, one pass that combines them into o_slc, lse_slc and sums the
    gated output o from o_cmp, o_slc and o_win (the gate pass's work; kernels-notes.md v40). tiled, tiled_by_block
    and per_query: once win has finished, their forward with that sum in the epilogue (v54)."""
    _check_scale(scale)
    k, v, blocks = _kv_rows(k), _kv_rows(v), blocks.contiguous()
    common = _selected_common(q, k, v, sel_block, blocks.shape[-1])
    gated = dict(GATES=gates.contiguous(), O_CMP=o_cmp, O_WIN=o_win, O_GATED=torch.empty_like(o_cmp))
    if kernel != "by_block":
        o_slc, lse_slc = _range_outputs(q, v)
        index = _selected_index(blocks, sel_block, kernel, common["H"] // common["G"])
        win.join()
        if kernel == "per_query":
            _per_query_fwd(q, k, v, blocks, o_slc, lse_slc, common, scale, gated)
        else:  # tiled_by_block's index is by_block's work list, for its backward: its forward builds the unions
            unions = index if kernel == "tiled" else _tile_unions(blocks, sel_block, common)
            _tiled_fwd(q, k, v, unions, o_slc, lse_slc, common, scale, gated)
        return gated["O_GATED"], o_slc, lse_slc, index
    # the outputs first, the partials after, as on the plain path: the partials' memory, freed after the combine,
    # is then one piece for what follows (allocated after them, the outputs left the T = 8192 training step 3 GB
    # more reserved memory, kernels-notes.md v40)
    o_slc, lse_slc = _range_outputs(q, v)
    index = _selected_index(blocks, sel_block, "by_block", common["H"] // common["G"])
    o_part, lse2_part = _selected_by_block_partials(q, k, v, index, common, scale)
    win.join()
    _combine_partials(o_part, lse2_part, blocks, o_slc, lse_slc, common, gated=gated)
    return gated["O_GATED"], o_slc, lse_slc, index


def _empty_range_output(q: torch.Tensor) -> torch.Tensor:
    """What nsa::core returns for o_cmp and o_win when its backward recomputes them."""
    return q.new_empty(0)


def _range_forwards(q, k_win, v_win, k_cmp, v_cmp, cmp_block: int, cmp_stride: int, window: int, scale: float):
    """((o_cmp, lse_cmp), (o_win, lse_win), win) of q (contiguous): the compressed branch in order, the window's
    started beside it; its results are there once win.join() has run."""
    T = q.shape[1]
    o_win, lse_win = _range_outputs(q, v_win)
    win = _Beside(q.device, lambda: _range_fwd_into(q, k_win, v_win, o_win, lse_win, T, *_win_range(window, T),
                                                    scale))
    return _range_fwd(q, k_cmp, v_cmp, *_cmp_range(cmp_block, cmp_stride, T), scale), (o_win, lse_win), win


def _recomputed_ranges(q, k_win, v_win, k_cmp, v_cmp, cmp_block: int, cmp_stride: int, window: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o_cmp and o_win as nsa::core's forward computed them: the same kernels on the same inputs (bit for bit;
    none of them adds atomically)."""
    (o_cmp, _), (o_win, _), win = _range_forwards(q, k_win, v_win, k_cmp, v_cmp, cmp_block, cmp_stride, window,
                                                  scale)
    win.join()
    return o_cmp, o_win


@torch.library.custom_op("nsa::core_bwd", mutates_args=())
def _core_bwd(do: torch.Tensor, q: torch.Tensor, k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor,
              v_win: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, gates: torch.Tensor,
              saved: list[torch.Tensor], cmp_block: int, cmp_stride: int, sel_block: int, window: int,
              scale: float, recompute: bool) -> list[torch.Tensor]:
    """[dq, dk_slc, dv_slc, dk_win, dv_win, dk_cmp, dv_cmp, dgates] of nsa::core, run under the launch config its
    forward ran with; saved = its outputs 1..."""
    blocks, o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, *index = saved
    # The variant the forward ran, chosen here rather than passed in: as an argument it would be a constant of a
    # compiled backward graph, which then changes with l' and n (_index_variant).
    kernel = attended_kernel(q.shape[2] // k_slc.shape[2], q.shape[1], sel_block, blocks.shape[-1])
    blocks, sel_block = _attended_blocks(blocks, sel_block)  # the parts the forward attended
    T = q.shape[1]
    q = q.contiguous()
    if recompute:
        o_cmp, o_win = _recomputed_ranges(q, k_win, v_win, k_cmp, v_cmp, cmp_block, cmp_stride, window, scale)
    # The gate backward also sums each branch's row term while it has do and o_i in registers, so no branch reads
    # them again for it. With the fused gate kernel the d_i = g_i * do are not formed at all: each branch's
    # backward runs on do with lse_i - ln g_i (three [B, T, H, Dv] writes and their memory saved, no gate work in
    # the attention kernels; kernels/gates.py).
    if _config.gate_kernel == "fused":
        dgates, delta, lse_g = _gated_bwd(gates, o_cmp, o_slc, o_win, do, lse=(lse_cmp, lse_slc, lse_win))
        d_cmp = d_slc = d_win = do
        lse_cmp, lse_slc, lse_win = lse_g
    else:
        dgates, d_cmp, d_slc, d_win, delta = _gated_bwd(gates, o_cmp, o_slc, o_win, do, with_delta=True)
    delta_cmp, delta_slc, delta_win = delta
    d_cmp, d_win = d_cmp.contiguous(), d_win.contiguous()
    cmp = (q, _kv_rows(k_cmp), _kv_rows(v_cmp), d_cmp, lse_cmp, delta_cmp, *_cmp_range(cmp_block, cmp_stride, T))
    win = (q, _kv_rows(k_win), _kv_rows(v_win), d_win, lse_win, delta_win, *_win_range(window, T))
    # dK/dV of the compressed and window branches feed nothing else here: beside the dQ kernels.
    dkdv = [_range_dkdv_outputs(q, r[1], r[2], r[-1]) for r in (cmp, win)]
    range_dkdv = _Beside(q.device, lambda: [_range_dkdv_into(*r[:6], dk, dv, T, r[1].shape[1], *r[6:], scale)
                                            for r, (dk, dv) in zip((cmp, win), dkdv)])
    if _slot_sum_in_range_dq(kernel):  # by_block's dQ slots first, summed by the range dQ kernel after
        dq_slots, dk_slc, dv_slc = _selected_bwd(q, k_slc, v_slc, blocks, o_slc, lse_slc, index, d_slc, sel_block,
                                                 scale, kernel, delta=delta_slc, dq_slots=True)
        dq = torch.empty_like(q)
        _range_dq_into(*cmp[:6], dq, T, *cmp[6:], scale, second=(*win[1:3], *win[4:]),
                       slots=(dq_slots, blocks.contiguous()))
    elif _config.range_dq_last and kernel == "tiled" and _range_pair_fused():
        dq, dk_slc, dv_slc = _selected_bwd(q, k_slc, v_slc, blocks, o_slc, lse_slc, index, d_slc, sel_block, scale,
                                           kernel, delta=delta_slc)
        _range_dq_into(*cmp[:6], dq, T, *cmp[6:], scale, accumulate=True, second=(*win[1:3], *win[4:]))
    else:
        if _range_pair_fused():  # d_cmp = d_win = do: one dQ launch for both branches
            dq_add = [torch.empty_like(q)]
            _range_dq_into(*cmp[:6], dq_add[0], T, *cmp[6:], scale, second=(*win[1:3], *win[4:]))
        else:
            dq_add = [torch.empty_like(q), torch.empty_like(q)]
            for (_, k, v, d, *rest), dq_range in zip((cmp, win), dq_add):
                _range_dq_into(q, k, v, d, *rest[:2], dq_range, T, *rest[2:], scale)
        # The selected branch's backward adds the other two branches' dQ into its own (by_block: in its slot sum).
        dq, dk_slc, dv_slc = _selected_bwd(q, k_slc, v_slc, blocks, o_slc, lse_slc, index, d_slc, sel_block, scale,
                                           kernel, delta=delta_slc, dq_add=tuple(dq_add))
    range_dkdv.join()
    (dk_cmp, dv_cmp), (dk_win, dv_win) = [(dk.to(r[1].dtype), dv.to(r[2].dtype))  # accumulators: cast
                                          for r, (dk, dv) in zip((cmp, win), dkdv)]
    return [dq, dk_slc, dv_slc, dk_win, dv_win, dk_cmp, dv_cmp, dgates]


def _slot_sum_in_range_dq(kernel: str) -> bool:
    """Whether nsa::core's backward sums by_block's dQ slots in the range dQ kernel (slc_slot_sum = "range_dq"):
    where the selected backward writes dQ slots (by_block's) and the range dQ is one launch for
    both branches."""
    return (_config.slc_slot_sum == "range_dq" and kernel in BY_BLOCK_BACKWARD and _config.slc_dq == "partial"
            and _range_pair_fused())


@_core_bwd.register_fake
def _core_bwd_fake(do, q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, saved, cmp_block, cmp_stride, sel_block,
                   window, scale, recompute):
    return [x.new_empty(x.shape) for x in (q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates)]


def _core_setup_context(ctx, inputs, output):
    q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cmp_block, cmp_stride, sel_block, _n_selected, window, \
        _n_init, _n_local, scale, recompute = inputs
    ctx.save_for_backward(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, *output[1:])
    # Only o carries a gradient. Without this autograd (and AOTAutograd's tangents under torch.compile) would fill
    # a zero gradient for each of the other 11 outputs at every backward: three [B, T, H, Dv] branch outputs among
    # them, about 150 MiB of memset per layer at 32k tokens.
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.params = (cmp_block, cmp_stride, sel_block, window, scale)
    ctx.recompute = recompute
    ctx.config = _config  # the backward runs under the launch config the forward ran with, so the same variant


def _core_backward(ctx, grads):
    q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, *saved = ctx.saved_tensors
    do = grads[0]  # the other outputs are selections and what the backward reads: no gradient flows through them
    with use_launch_config(ctx.config):
        dq, dk_slc, dv_slc, dk_win, dv_win, dk_cmp, dv_cmp, dgates = torch.ops.nsa.core_bwd(
            do, q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, saved, *ctx.params, ctx.recompute)
    return dq, dk_slc, dv_slc, dk_win, dv_win, dk_cmp, dv_cmp, dgates, *(None,) * 9


_core.register_autograd(_core_backward, setup_context=_core_setup_context)


def nsa_attention(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg: NSAConfig, *, scale: float,
                  return_blocks: bool = False, recompute: bool = False):
    """recompute: keep the selected branch's output for the backward but not the compressed and window branches'
    (2 x [B, T, H, Dv]); the backward runs their forward kernels again (kernels-notes.md, v27)."""
    _check_inputs(q=q, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win, k_cmp=k_cmp, v_cmp=v_cmp, gates=gates)
    o, blocks, *_ = torch.ops.nsa.core(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, cfg.cmp_block,
                                       cfg.cmp_stride, cfg.sel_block, cfg.n_selected, cfg.window, cfg.n_init_blocks,
                                       cfg.n_local_blocks, float(scale), bool(recompute))
    return (o, blocks) if return_blocks else o


# --- RoPE and the split of the fused q/k/v projection (the attention modules' own op, outside the NSA core) ----
_ROPE_TOKENS = 8  # tokens per program of the RoPE kernel (every part of each)


def _rope_launch(y: torch.Tensor, parts: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 rotate: list[bool], inverse: bool, position: torch.Tensor | None = None,
                 to_position: list[bool] | None = None) -> None:
    """One launch over every part: forward (inverse False) part i = y's columns rotated by position t's angles
    or copied; backward each part (a gradient) turned back by minus them, or copied, into its columns of y. y
    [B, T, width] with contiguous columns, parts [B, T, heads_i, D_i] with any batch, token and head strides
    (last dimension contiguous). position (forward only): y's tokens are positions p .. (p read on the device),
    cos and sin whole tables, and the parts with to_position[i] buffers [B, L, heads_i, D_i] written at rows
    p .. (rope_split_at)."""
    B, T = y.shape[:2]
    heads = [p.shape[2] for p in parts]
    dims = [p.shape[3] for p in parts]
    cols = [sum(h * d for h, d in zip(heads[:i], dims[:i])) for i in range(len(parts))]
    to_position = to_position or [False] * len(parts)
    if B * T and parts:
        rope_split_kernel[(triton.cdiv(B * T, _ROPE_TOKENS),)](
            y, tuple(parts), cos, sin, y if position is None else position, B * T, T, y.stride(0), y.stride(1),
            *(tuple(p.stride(i) for p in parts) for i in range(3)),
            COLS=tuple(cols), HEADS=tuple(heads), HEADS_PAD=tuple(_pow2(h, floor=1) for h in heads),
            DIMS=tuple(dims), BLOCK_DIMS=tuple(_pow2(d, floor=2) for d in dims), ROTATE=tuple(rotate),
            INVERSE=inverse, AT_POS=position is not None, TO_POS=tuple(to_position), BLOCK_T=_ROPE_TOKENS)


def _check_rope_parts(y, cos, sin, heads, head_dims, rotate) -> None:
    _check_inputs(y=y)
    if y.dim() != 3 or y.stride(-1) != 1:
        raise ValueError(f"y: expected [B, T, width] with contiguous columns, got {tuple(y.shape)} strides "
                         f"{y.stride()}")
    width = sum(h * d for h, d in zip(heads, head_dims))
    if not len(heads) == len(head_dims) == len(rotate) or width != y.shape[-1]:
        raise ValueError(f"rope_split: parts of {heads} heads x {head_dims} dims must tile y's width {y.shape[-1]}")
    rotated = [d for d, r in zip(head_dims, rotate) if r]
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or not table.is_contiguous() or table.shape[0] < y.shape[1] or any(
                table.shape[1] != d // 2 for d in rotated):
            raise ValueError(f"{name}: expected a contiguous float32 [>= T, D/2] table for the rotated parts' "
                             f"head dims {rotated}, got {table.dtype} {tuple(table.shape)}")


@torch.library.custom_op("nsa::rope_split", mutates_args=())
def _rope_split(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: list[int], head_dims: list[int],
                rotate: list[bool]) -> list[torch.Tensor]:
    """The parts of y [B, T, width] (columns in order), each a new contiguous [B, T, heads_i, head_dims_i]:
    rotated by RoPE where rotate_i, copied otherwise."""
    outs = [y.new_empty(*y.shape[:2], h, d) for h, d in zip(heads, head_dims)]
    _rope_launch(y, outs, cos, sin, rotate, inverse=False)
    return outs


@_rope_split.register_fake
def _rope_split_fake(y, cos, sin, heads, head_dims, rotate):
    return [y.new_empty(*y.shape[:2], h, d) for h, d in zip(heads, head_dims)]


@torch.library.custom_op("nsa::rope_split_bwd", mutates_args=())
def _rope_split_bwd(grads: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, heads: list[int],
                    head_dims: list[int], rotate: list[bool]) -> torch.Tensor:
    """dy [B, T, width] of nsa::rope_split: each part's gradient turned back (or copied) into its columns."""
    B, T = grads[0].shape[:2]
    dy = grads[0].new_empty(B, T, sum(h * d for h, d in zip(heads, head_dims)))
    _rope_launch(dy, [g if g.stride(-1) == 1 else g.contiguous() for g in grads], cos, sin, rotate, inverse=True)
    return dy


@_rope_split_bwd.register_fake
def _rope_split_bwd_fake(grads, cos, sin, heads, head_dims, rotate):
    return grads[0].new_empty(*grads[0].shape[:2], sum(h * d for h, d in zip(heads, head_dims)))


def _rope_split_setup_context(ctx, inputs, output):
    _, cos, sin, heads, head_dims, rotate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.parts = (heads, head_dims, rotate)


def _rope_split_backward(ctx, grads):
    cos, sin = ctx.saved_tensors
    return torch.ops.nsa.rope_split_bwd(list(grads), cos, sin, *ctx.parts), None, None, None, None, None


_rope_split.register_autograd(_rope_split_backward, setup_context=_rope_split_setup_context)


def rope_split(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: list[int], head_dims: list[int],
               rotate: list[bool]) -> list[torch.Tensor]:
    """y [B, T, width] split into parts [B, T, heads_i, head_dims_i] (columns in order), part i rotated by RoPE
    (tables cos, sin [>= T, D/2] float32) where rotate_i, copied otherwise; one Triton launch each way."""
    _check_rope_parts(y, cos, sin, heads, head_dims, rotate)
    return torch.ops.nsa.rope_split(y, cos, sin, list(heads), list(head_dims), list(rotate))


@torch.no_grad()
def rope_split_at(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: list[int], head_dims: list[int],
                  rotate: list[bool], position: torch.Tensor, into: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """rope_split of a decoding step's y [B, T, width] at positions p .. p + T - 1, p the int64 in `position` (on
    the device: a CUDA graph of the step serves every position): cos, sin the whole tables [L, D/2] (read at those
    rows); part i written into into[i], a buffer [B, L, heads_i, head_dims_i] of a decoding cache, at rows
    p .. (then returned in its place), or a new tensor where into[i] is None. One launch, no grad; the caller keeps
    p + T within the tables and the buffers (ModelCache.room_for)."""
    _check_inputs(y=y)
    if y.dim() != 3 or y.stride(-1) != 1 or sum(h * d for h, d in zip(heads, head_dims)) != y.shape[-1]:
        raise ValueError(f"rope_split_at: parts of {heads} heads x {head_dims} dims must tile y [B, T, width] "
                         f"with contiguous columns, got {tuple(y.shape)} strides {y.stride()}")
    rotated = {d // 2 for d, r in zip(head_dims, rotate) if r}
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or not table.is_contiguous() or rotated - {table.shape[1]}:
            raise ValueError(f"{name}: expected a whole contiguous table [L, D/2] for the rotated parts' head dims "
                             f"{sorted(2 * h for h in rotated)}, got {tuple(table.shape)}")
    if position.numel() != 1 or position.dtype != torch.int64 or position.device != y.device:
        raise ValueError(f"position: expected one int64 on {y.device}, got {position.dtype} {tuple(position.shape)} "
                         f"on {position.device}")
    parts = []
    for i, (h, d, buffer) in enumerate(zip(heads, head_dims, into, strict=True)):
        if buffer is not None and (buffer.dim() != 4 or buffer.shape[0] != y.shape[0] or
                                   tuple(buffer.shape[2:]) != (h, d) or buffer.stride(-1) != 1):
            raise ValueError(f"into[{i}]: expected a buffer [{y.shape[0]}, L, {h}, {d}] with a contiguous last dim, "
                             f"got {tuple(buffer.shape)} strides {buffer.stride()}")
        parts.append(y.new_empty(*y.shape[:2], h, d) if buffer is None else buffer)
    _rope_launch(y, parts, cos, sin, rotate, inverse=False, position=position,
                 to_position=[buffer is not None for buffer in into])
    return parts


# --- the decoding step (outside the training core: NSAAttention.decode through ops/decode.py; kernels/decode.py) --

def decode_supports(cfg: NSAConfig) -> bool:
    """Whether the decoding kernels run cfg's step: LaunchConfig.decode_kernel is "triton" and the tokens starting
    in a selection block, l'/d, are a power of two (the banded importance is a reshape). ops/decode.py runs the
    PyTorch step otherwise."""
    if _config.decode_kernel != "triton":
        return False
    per_block = cfg.sel_block // cfg.cmp_stride
    return per_block & (per_block - 1) == 0


_DECODE_CHUNK = 64  # compressed slots, or window keys, a decoding program: a power of two >= 16
_DECODE_MERGE_ROWS = 64  # partials a load when the combine kernel merges a head's (a power of two)
_DECODE_TOPN_SEGMENT: int | None = None  # blocks a segment of the attend kernel's top-n; None: _topn_segment's


def _topn_segment(nb_pad: int, n_pad: int) -> int:
    """Blocks a segment in the attend kernel's two-level top-n (1: one level): about sqrt(NB_PAD / N_PAD), which
    makes its two sets of rounds (over NB_PAD / SEGMENT maxima, then N_PAD * SEGMENT keys) alike in size. One
    level up to NB_PAD = 64 N_PAD: the second level's loads and reshapes cost about 4 us, which fewer rounds repay
    only past that (nsa-125m on an H200, v69: the attend kernel 7.5 -> 9.5 us at 32k positions with two levels,
    17.8 -> 11.3 at 128k, where the rounds are 2 x 16 over 256 keys in place of 16 over 4,096)."""
    if _DECODE_TOPN_SEGMENT is not None:
        return _DECODE_TOPN_SEGMENT
    ratio = nb_pad // n_pad
    return 1 if ratio <= 64 else 2 ** ((ratio.bit_length()) // 2)


_DECODE_ATTEND_PROGRAMS = 512  # the attend kernel's programs a step, at least, before each takes more blocks
_DECODE_PARTS: int | None = None  # chosen blocks an attend program takes; None: _attend_parts's


def _attend_parts(rows: int, n: int) -> int:
    """Chosen blocks an attend program takes (its PARTS): the largest power of two up to n that still leaves at
    least _DECODE_ATTEND_PROGRAMS programs (rows * ceil(n / PARTS)); 1 where two would leave fewer. Each program
    makes the whole top-n, so n programs a row repeat it n times; many rows (samples drawn together) fill the
    GPU without them. v70, nsa-125m at 32k positions on an H200 (rows = 2 a sample): 64 samples' graph step 2.25 ms
    at PARTS 1, 2.07 at 2, 1.97 at 4, 2.19 at 8; at 16 samples 1.35 / 1.33 / 1.39; at 1 sample PARTS 1 best."""
    if _DECODE_PARTS is not None:
        return _DECODE_PARTS
    parts = 1
    while parts * 2 <= n and rows * triton.cdiv(n, parts * 2) >= _DECODE_ATTEND_PROGRAMS:
        parts *= 2
    return parts


def decode_step(q, k_slc, v_slc, k_win, v_win, k_cmp, v_cmp, gates, position: torch.Tensor, cfg: NSAConfig,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, H, Dv], blocks [B, G, n]) of one query a row at `position` (a 1-element int64 tensor), as
    ops/decode.py's nsa_decode_step (shapes checked there): four launches (kernels/decode.py)."""
    _check_inputs(q=q, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win, k_cmp=k_cmp, v_cmp=v_cmp, gates=gates)
    if not decode_supports(cfg):
        raise ValueError(f"decode_step: needs LaunchConfig.decode_kernel='triton' and l'/d a power of two, got "
                         f"{_config.decode_kernel!r} and {cfg.sel_block}/{cfg.cmp_stride}")
    for name, x in (("q", q), ("k_slc", k_slc), ("v_slc", v_slc), ("k_win", k_win), ("v_win", v_win),
                    ("k_cmp", k_cmp), ("v_cmp", v_cmp), ("gates", gates)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the decoding kernels read rows with a contiguous last dim, got strides "
                             f"{x.stride()}")
    B, H, Dk = q.shape
    L, G, Dv, S = k_slc.shape[1], k_slc.shape[2], v_slc.shape[-1], k_cmp.shape[1]
    num_blocks = triton.cdiv(L, cfg.sel_block)
    per_block = cfg.sel_block // cfg.cmp_stride
    chunk = max(_DECODE_CHUNK, per_block)  # whole blocks of compressed slots a program (both powers of two)
    block_n = min(64, chunk)
    chunks = max(1, triton.cdiv(S, chunk))
    win_tiles = triton.cdiv(min(cfg.window, L), chunk)
    nb_pad, n_pad = _pow2(num_blocks), _pow2(cfg.n_selected, 2)
    segment = _topn_segment(nb_pad, n_pad)
    rows = B * G
    hp, block_dk, block_dv = _pow2(H // G), _pow2(Dk), _pow2(Dv)  # heads padded to tl.dot's 16 rows
    f32 = dict(dtype=torch.float32, device=q.device)

    def partials(count):  # (m, l, acc) of `count` online softmaxes a (batch, group)
        return (torch.empty(rows, count, hp, **f32), torch.empty(rows, count, hp, **f32),
                torch.empty(rows, count, hp, block_dv, **f32))

    cmp, slc, win = partials(chunks), partials(cfg.n_selected), partials(win_tiles)
    importance = torch.empty(rows, 2, nb_pad, **f32)
    o = torch.empty(B, H, Dv, dtype=v_slc.dtype, device=q.device)
    blocks = torch.empty(B, G, cfg.n_selected, dtype=torch.int32, device=q.device)
    qk_scale = scale * math.log2(math.e)
    common = dict(G=G, HPG=H // G, HP=hp, DK=Dk, BLOCK_DK=block_dk, CMP_BLOCK=cfg.cmp_block,
                  CMP_STRIDE=cfg.cmp_stride, DOT_PRECISION=_dot_precision(q.dtype), num_warps=4)
    nsa_decode_cmp_kernel[(rows, chunks + win_tiles)](
        q, k_cmp, v_cmp, k_win, v_win, position, *cmp, *win, q.stride(0), q.stride(1), *k_cmp.stride()[:3],
        *v_cmp.stride()[:3], *k_win.stride()[:3], *v_win.stride()[:3], qk_scale, DV=Dv, BLOCK_DV=block_dv,
        BLOCK_N=block_n, CHUNK=chunk, CHUNKS=chunks, WIN_TILES=win_tiles, WINDOW=cfg.window, **common)
    nsa_decode_importance_kernel[(rows, chunks)](
        q, k_cmp, position, cmp[0], cmp[1], importance, q.stride(0), q.stride(1), *k_cmp.stride()[:3], qk_scale,
        CHUNK=chunk, CHUNKS=chunks, CHUNKS_PAD=_pow2(chunks, 1), TOKENS=max(block_n, per_block),
        SEL_BLOCK=cfg.sel_block, NB_PAD=nb_pad, **common)
    parts = _attend_parts(rows, cfg.n_selected)
    nsa_decode_attend_kernel[(rows, triton.cdiv(cfg.n_selected, parts))](
        q, k_slc, v_slc, position, importance, blocks, *slc, q.stride(0), q.stride(1), *k_slc.stride()[:3],
        *v_slc.stride()[:3], num_blocks, qk_scale, DV=Dv, BLOCK_DV=block_dv,
        SEL_TILE=min(block_n, _pow2(cfg.sel_block)), SEL_BLOCK=cfg.sel_block, N_SEL=cfg.n_selected, N_PAD=n_pad,
        N_INIT=cfg.n_init_blocks, N_LOCAL=cfg.n_local_blocks, NB_PAD=nb_pad, SEGMENT=segment, PARTS=parts, **common)
    nsa_decode_combine_kernel[(B * H,)](
        *cmp, *slc, *win, gates, o, gates.stride(0), gates.stride(1), G=G, HPG=H // G, HP=hp, DV=Dv,
        BLOCK_DV=block_dv, CHUNKS=chunks, N_SEL=cfg.n_selected, WIN_TILES=win_tiles,
        MERGE_ROWS=_DECODE_MERGE_ROWS, num_warps=4)
    return o, blocks


# --- the attention module's statistics (outside the NSA core; kernels/stats.py) ------------------------------------
_STATS_TOKENS = 32  # token rows per step of the statistics kernel
_STATS_PROGRAMS = 1024  # programs at most, whose rows the caller adds up


def _stats_programs(num_tokens: int) -> int:
    return max(1, min(_STATS_PROGRAMS, triton.cdiv(num_tokens, _STATS_TOKENS)))


@torch.library.custom_op("nsa::attention_stat_sums", mutates_args=())
def _attention_stat_sums(blocks: torch.Tensor, gates: torch.Tensor, sel_block: int) -> torch.Tensor:
    """[programs, 5] float32: each program's sums of the three gates, of the chosen slots and of their distances
    (t // sel_block - block); the statistics are the column sums (attention_stat_sums)."""
    B, T, G, n = blocks.shape
    H = gates.shape[2]
    blocks, gates = blocks.contiguous(), gates.contiguous()
    programs = _stats_programs(B * T)
    parts = torch.empty(programs, 5, dtype=torch.float32, device=blocks.device)
    tokens_per_program = triton.cdiv(triton.cdiv(B * T, programs), _STATS_TOKENS) * _STATS_TOKENS
    attention_stats_kernel[(programs,)](blocks, gates, parts, B * T, T, tokens_per_program, SLOTS=G * n,
                                        SLOTS_PAD=_pow2(G * n, floor=1), GATE_COLS=H * 3,
                                        GATE_PAD=_pow2(H * 3, floor=4), SEL_BLOCK=sel_block, TOKENS=_STATS_TOKENS)
    return parts


@_attention_stat_sums.register_fake
def _attention_stat_sums_fake(blocks, gates, sel_block):
    return blocks.new_empty(_stats_programs(blocks.shape[0] * blocks.shape[1]), 5, dtype=torch.float32)


def attention_stat_sums(blocks: torch.Tensor, gates: torch.Tensor, sel_block: int) -> torch.Tensor:
    """[5] float32 for selections blocks [B, T, G, n] (int32, -1 = none) and gates [B, T, H, 3]: the sums of
    gate cmp, slc and win over every (b, t, h), the number of chosen slots, and the sum of the chosen blocks'
    distances t // sel_block - block. One Triton launch, then a sum over its programs' rows (at most 1024)."""
    _check_inputs(gates=gates)
    if blocks.dim() != 4 or blocks.dtype != torch.int32 or gates.dim() != 4 or gates.shape[-1] != 3 or \
            gates.shape[:2] != blocks.shape[:2]:
        raise ValueError(f"attention_stat_sums: expected blocks [B, T, G, n] int32 and gates [B, T, H, 3] of the "
                         f"same B, T; got {blocks.dtype} {tuple(blocks.shape)} and {tuple(gates.shape)}")
    return torch.ops.nsa.attention_stat_sums(blocks, gates, sel_block).sum(0)


# --- phi = mlp: the attention module's compression of a K or V set (outside the NSA core; kernels/compress.py) ----
_PHI_W1_ROWS = 64  # rows (compressed token, group) per step of the W1-gradient kernel
_PHI_DX_ROWS = 64  # (batch, chunk) rows per program of the x-gradient kernel
# offsets u (token t = c * d + u) per program of the x-gradient kernel, where d allows (their gcd): all 16 of
# nsa-125m's d took phi's k and v sets from 104-105 to 99-100 us a layer call on an H100 (kernels-notes.md v49)
_PHI_DX_OFFSETS = 16


def _check_phi(x, w1, b1, w2, b2, block: int, stride: int) -> None:
    _check_inputs(x=x)
    if x.dim() != 4 or x.stride(-1) != 1:
        raise ValueError(f"phi x: expected [B, T, G, D] with a contiguous last dimension, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    T, D, hidden = x.shape[1], x.shape[3], w1.shape[0]
    if stride < 1 or block % stride or T < block:
        raise ValueError(f"phi: the block l={block} must be a multiple of the stride d={stride} and at most "
                         f"T={T} (no compressed token exists below l)")
    for name, t, shape in (("fc1.weight", w1, (hidden, block * D)), ("fc1 bias", b1, (hidden,)),
                           ("fc2.weight", w2, (D, hidden)), ("fc2.bias", b2, (D,))):
        if tuple(t.shape) != shape or t.dtype not in SUPPORTED_DTYPES or t.device != x.device:
            raise ValueError(f"phi {name}: expected {shape} in one of {SUPPORTED_DTYPES} on {x.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")


def _phi_sizes(x: torch.Tensor, w1: torch.Tensor, block: int, stride: int):
    """(sets S, B, T, G, D, hidden, Tc, the launches' shared constexprs) for stacked weights w1 [S, hidden, l*D]."""
    B, T, G, D = x.shape
    sets, hidden = w1.shape[0], w1.shape[1]
    consts = dict(G=G, D=D, BLOCK_D=_pow2(D), HID=hidden, BLOCK_H=_pow2(hidden), DOT_PRECISION=_dot_precision(x.dtype))
    return sets, B, T, G, D, hidden, (T - block) // stride + 1, consts


@torch.library.custom_op("nsa::phi_mlp", mutates_args=())
def _phi_mlp(x0: torch.Tensor, x1: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             b2: torch.Tensor, block: int, stride: int) -> list[torch.Tensor]:
    """[y [S, B, Tc, G, D], h [S, B * Tc, G, hidden] float32 (fc1's output, kept for the backward)] of the S =
    w1.shape[0] sets (1 or 2): set 0 on x0 with the weights w1[0], b1[0], w2[0], b2[0], set 1 on x1 with the
    others (x1 unread when S = 1)."""
    sets, B, T, G, D, hidden, tc, consts = _phi_sizes(x0, w1, block, stride)
    if sets not in (1, 2) or x1.shape != x0.shape or x1.stride() != x0.stride():
        raise ValueError(f"nsa::phi_mlp: one or two sets of weights (got {sets}) and x1 with x0's shape and strides "
                         f"(got {tuple(x1.shape)} {x1.stride()} against {tuple(x0.shape)} {x0.stride()})")
    y = x0.new_empty(sets, B, tc, G, D)
    hs = torch.empty(sets, B * tc, G, hidden, dtype=torch.float32, device=x0.device)
    rows = _config.phi_rows
    if B * tc:
        phi_fwd_kernel[(triton.cdiv(B * tc, rows), G, sets)](
            x0, x1, w1.to(x0.dtype).contiguous(), b1.float().contiguous(), w2.contiguous(), b2.float().contiguous(),
            y, hs, B * tc, tc, *x0.stride()[:3], L=block, STRIDE=stride, BLOCK_R=rows, **consts)
    return [y, hs]


@_phi_mlp.register_fake
def _phi_mlp_fake(x0, x1, w1, b1, w2, b2, block, stride):
    B, T, G, D = x0.shape
    tc = (T - block) // stride + 1
    return [x0.new_empty(w1.shape[0], B, tc, G, D), x0.new_empty(w1.shape[0], B * tc, G, w1.shape[1],
                                                                  dtype=torch.float32)]


@torch.library.custom_op("nsa::phi_mlp_bwd", mutates_args=())
def _phi_mlp_bwd(dy: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor, hs: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, block: int, stride: int) -> list[torch.Tensor]:
    """[dx [S, B, T, G, D], dW1 [S, hidden, l*D], sums [S, D * hidden + D + hidden]] of nsa::phi_mlp, dW1 and sums
    float32; sums holds dW2, d b2 and d bias, flat (one sum over the row programs' shares; _phi_grad_sums takes
    them apart)."""
    sets, B, T, G, D, hidden, tc, consts = _phi_sizes(x0, w1, block, stride)
    dy = dy.contiguous()
    dh = torch.empty(sets, B * tc, G, hidden, dtype=x0.dtype, device=x0.device)
    R, rows = B * tc, _config.phi_rows
    programs = max(1, triton.cdiv(R, rows) * G)
    parts = torch.empty(sets, programs, D * hidden + D + hidden, dtype=torch.float32, device=x0.device)
    if R:
        phi_bwd_rows_kernel[(triton.cdiv(R, rows), G, sets)](dy, hs, w2.contiguous(), dh, parts, R, BLOCK_R=rows,
                                                             **consts)
    else:
        parts.zero_()
    sums = parts.sum(1)
    # W1's gradient: a program per (block position, split of the rows, set), about a wave of programs; every
    # element of every split is stored, so no memset
    tiles = triton.cdiv(R * G, _PHI_W1_ROWS)
    per_split = triton.cdiv(tiles, max(1, min(tiles, 128 // block)))
    splits = max(1, triton.cdiv(tiles, per_split))
    dw1 = torch.empty(sets, splits, hidden, block * D, dtype=torch.float32, device=x0.device)
    if R:
        phi_bwd_w1_kernel[(block, splits, sets)](x0, x1, dh, dw1, R, tc, per_split, *x0.stride()[:3], L=block,
                                                 STRIDE=stride, BLOCK_R=_PHI_W1_ROWS, **consts)
    else:
        dw1.zero_()
    dw1 = dw1[:, 0] if splits == 1 else dw1.sum(1)
    chunks = triton.cdiv(T, stride)
    dx = x0.new_empty(sets, B, T, G, D)
    offsets = math.gcd(stride, _PHI_DX_OFFSETS)
    if B * T:
        # W1 cast once here, as the forward's is: every program loads its slices, in half the bytes
        phi_bwd_x_kernel[(triton.cdiv(B * chunks, _PHI_DX_ROWS), sets * G, stride // offsets)](
            dh, w1.to(dh.dtype).contiguous(), dx, T, tc, chunks, B * chunks, STRIDE=stride, PIECES=block // stride,
            BLOCK_R=_PHI_DX_ROWS, OFFSETS=offsets, **consts)
    return [dx, dw1, sums]


def _phi_grad_sums(sums: torch.Tensor, D: int, hidden: int):
    """(dW2 [S, D, hidden], d b2 [S, D], d bias [S, hidden]): views of nsa::phi_mlp_bwd's flat sums [S, ...]."""
    S = sums.shape[0]
    return (sums[:, :D * hidden].view(S, D, hidden), sums[:, D * hidden:D * hidden + D],
            sums[:, D * hidden + D:])


@_phi_mlp_bwd.register_fake
def _phi_mlp_bwd_fake(dy, x0, x1, hs, w1, w2, block, stride):
    sets, D, hidden = w2.shape
    return [x0.new_empty(sets, *x0.shape), w1.new_empty(w1.shape, dtype=torch.float32),
            w1.new_empty(sets, D * hidden + D + hidden, dtype=torch.float32)]


def _phi_mlp_setup_context(ctx, inputs, output):
    x0, x1, w1, b1, w2, b2, block, stride = inputs
    ctx.save_for_backward(x0, x1, output[1], w1, w2)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.params = (block, stride)
    ctx.dtypes = (b1.dtype, b2.dtype)
    ctx.config = _config


def _phi_mlp_backward(ctx, grads):
    x0, x1, hs, w1, w2 = ctx.saved_tensors
    with use_launch_config(ctx.config):
        dx, dw1, sums = torch.ops.nsa.phi_mlp_bwd(grads[0], x0, x1, hs, w1, w2, *ctx.params)
    dw2, db2, db1 = _phi_grad_sums(sums, *w2.shape[1:])
    # one set: x1 is x0 again, unread, and gets no gradient (autograd would add a second one into x0's)
    dx1 = dx[1] if w1.shape[0] == 2 else None
    return (dx[0], dx1, dw1.to(w1.dtype), db1.to(ctx.dtypes[0]), dw2.to(w2.dtype), db2.to(ctx.dtypes[1]), None,
            None)


_phi_mlp.register_autograd(_phi_mlp_backward, setup_context=_phi_mlp_setup_context)


def phi_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, block: int,
            stride: int) -> torch.Tensor:
    """phi = mlp of NSA_SPEC.md on x [B, T, G, D] (T >= block): y [B, Tc, G, D] with y[:, i] = W2 gelu(W1
    flatten(x[:, i*stride : i*stride + block]) + b1) + b2, where b1 already holds fc1's share of the position
    embedding (attention.Compressor). Computes in x's dtype with float32 accumulation (the weights cast to it, as
    autocast does); one Triton launch forward, three backward."""
    _check_phi(x, w1, b1, w2, b2, block, stride)
    return torch.ops.nsa.phi_mlp(x, x, w1[None], b1[None], w2[None], b2[None], block, stride)[0][0]


def phi_mlp_pair(x_k: torch.Tensor, x_v: torch.Tensor, stacked: tuple, block: int,
                 stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi_mlp(x_k, w1[0], b1[0], w2[0], b2[0], ...), phi_mlp(x_v, w1[1], ...)) in the launches of one: x_k and
    x_v of one shape, stacked = (w1, b1, w2, b2) each [2, ...], the keys' weights then the values' (NSA's
    compressed keys and values at Dk = Dv; Compressor.pair_weights)."""
    if len(stacked) != 4 or any(w.dim() < 2 or w.shape[0] != 2 for w in stacked):
        raise ValueError(f"phi pair: expected stacked (w1, b1, w2, b2) of shape [2, ...] each, got "
                         f"{[tuple(w.shape) for w in stacked]}")
    _check_phi(x_k, *(w[0] for w in stacked), block, stride)
    _check_phi(x_v, *(w[1] for w in stacked), block, stride)
    if x_k.shape != x_v.shape or x_k.dtype != x_v.dtype:
        raise ValueError(f"phi pair: x_k and x_v must have one shape and dtype, got {tuple(x_k.shape)} "
                         f"{x_k.dtype} and {tuple(x_v.shape)} {x_v.dtype}")
    if x_k.stride() != x_v.stride():  # one set of strides addresses both in the kernels
        x_k, x_v = x_k.contiguous(), x_v.contiguous()
    y = torch.ops.nsa.phi_mlp(x_k, x_v, *stacked, block, stride)[0]
    return y[0], y[1]
