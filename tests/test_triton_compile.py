"""The Triton kernels compile for the GPU (sm_90, Hopper) on a machine without one.

CI runs the kernels in Triton's interpreter, which executes their Python directly and so accepts code the
compiler rejects: a helper that returned early from inside a static `if` ran there and failed to compile on the
H100 (kernels-notes.md, v17; compiled Triton also visits the statements after such a return). Triton's front end,
its LLVM back end and the ptxas bundled with it need no GPU, so every kernel is compiled to a cubin here, once per
constexpr branch its launcher chooses among, with the default launch options, in a subprocess: this test session
imports the kernels interpreted (TRITON_INTERPRET=1), the subprocess compiled.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from bench.kernel_registers import COMPILE  # the compile script, shared with the register survey

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each case: (kernel, module, pointer dtypes by argument name (bf16 where not named), scalar types, constexprs,
# launch options). The shapes are nsa-125m's (12 heads, 2 groups, head dim 64), the options the defaults'.
D64 = dict(DK=64, DV=64, BLOCK_DK=64, BLOCK_DV=64, DOT_PRECISION="tf32")
SEL = dict(H=12, G=2, SEL_BLOCK=64, BLOCK_S=64, N_SELECT=16, **D64)
RANGE = dict(H=12, G=2, BLOCK_M=64, BLOCK_N=64, EDGE_SPLIT=True, **D64)
KV_ROWS = dict(K_ROW="i32", V_ROW="i32")
RANGE_SCALARS = dict(T="i32", num_queries="i32", num_keys="i32", scale="fp32", key_stride="i32", key_offset="i32",
                     window="i32", **KV_ROWS)
ROW_TERMS = dict(LSE="fp32", DELTA="fp32")
SLC_SCALARS = dict(T="i32", scale="fp32", **KV_ROWS)
BLOCK_INDEX = dict(ORDER="i32", STARTS="i32", WORK_SEG="i32", WORK_CHUNK="i32")
ACCS = dict(DK_ACC="fp32", DV_ACC="fp32")
GATES_BWD = dict(DGATES="bf16", DELTA="fp32", LSE_CMP="fp32", LSE_SLC="fp32", LSE_WIN="fp32", LSE_G="fp32")
WARPS4 = dict(num_warps=4, num_stages=2)
PHI = dict(G=2, D=64, BLOCK_D=64, HID=128, BLOCK_H=128, DOT_PRECISION="tf32")
PHI_RUN = dict(num_warps=4, num_stages=3)  # Triton's defaults: the phi launchers pass none
# NSA's fused projection as rope_split's parts: q, the three K sets (rotated), the three V sets, the gate logits
NSA_PARTS = dict(COLS=[0, 768, 896, 1024, 1152, 1280, 1408, 1536], HEADS=[12, 2, 2, 2, 2, 2, 2, 1],
                 HEADS_PAD=[16, 2, 2, 2, 2, 2, 2, 1], DIMS=[64] * 8, BLOCK_DIMS=[64] * 8,
                 ROTATE=[True] * 4 + [False] * 4)


def _case(name, module, pointers, scalars, constexprs, options=WARPS4, label=""):
    return pytest.param("nsa_model.kernels." + module, name, pointers, scalars, constexprs, options,
                        id=f"{name}[{label}]" if label else name)


def _tma_cases(name, module, pointers, scalars, constexprs, options=WARPS4, label="", descs=None):
    """The kernel with TMA = True, its tile arguments tensor descriptors of the block rows in descs (head dim
    64, bf16), and with TMA = False, those arguments plain pointers (unread), as the launchers pass them."""
    with_desc = dict(pointers, **{arg: f"tensordesc<bf16[{rows}, 64]>" for arg, rows in descs.items()})
    return [_case(name, module, ptrs, scalars, dict(constexprs, TMA=tma), options,
                  ",".join(x for x in (label, f"TMA={tma}") if x))
            for tma, ptrs in ((True, with_desc), (False, pointers))]


DECODE = dict(G=2, HPG=6, HP=16)  # 6 heads a group padded to tl.dot's 16 rows
DECODE_DIMS = dict(DK=64, BLOCK_DK=64, CMP_BLOCK=32, CMP_STRIDE=16, DOT_PRECISION="tf32")
Q_STRIDES = ("sqb", "sqh")
CMP_STRIDES = ("scb", "sct", "scg")
PARTIALS = dict(PM="fp32", PL="fp32", PACC="fp32")
DECODE_CASES = [  # (kernel, pointer dtypes, stride names, other scalars, constexprs); 8k positions: 32 chunks
    ("nsa_decode_cmp_kernel", dict(POS="i64", WM="fp32", WL="fp32", WACC="fp32", **PARTIALS),
     Q_STRIDES + CMP_STRIDES + tuple(f"{p}{d}" for p in ("svc", "swk", "swv") for d in "btg"),
     dict(qk_scale="fp32"),
     dict(DECODE_DIMS, DV=64, BLOCK_DV=64, BLOCK_N=64, CHUNK=64, CHUNKS=32, WIN_TILES=8, WINDOW=512)),
    ("nsa_decode_importance_kernel", dict(POS="i64", PM="fp32", PL="fp32", IMP="fp32"), Q_STRIDES + CMP_STRIDES,
     dict(qk_scale="fp32"),
     dict(DECODE_DIMS, CHUNK=64, CHUNKS=32, CHUNKS_PAD=32, TOKENS=64, SEL_BLOCK=64, NB_PAD=256)),
    *[("nsa_decode_attend_kernel", dict(POS="i64", IMP="fp32", BLOCKS="i32", **PARTIALS),
       Q_STRIDES + tuple(f"{p}{d}" for p in ("sk", "sv") for d in "btg"), dict(num_blocks="i32", qk_scale="fp32"),
       dict(DECODE_DIMS, DV=64, BLOCK_DV=64, SEL_TILE=64, SEL_BLOCK=64, N_SEL=16, N_PAD=16, N_INIT=1, N_LOCAL=2,
            NB_PAD=nb_pad, SEGMENT=segment, PARTS=parts))
      # one level; two at 16k and at 128k positions; 4 and all 16 chosen blocks a program (many rows a step)
      for nb_pad, segment, parts in ((64, 1, 1), (256, 4, 1), (2048, 16, 1), (512, 1, 4), (512, 1, 16))],
    ("nsa_decode_combine_kernel", {name: "fp32" for name in ("CM", "CL", "CACC", "SM", "SL", "SACC", "WM", "WL",
                                                            "WACC")},
     ("sgb", "sgh"), {}, dict(DV=64, BLOCK_DV=64, CHUNKS=32, N_SEL=16, WIN_TILES=8, MERGE_ROWS=64)),
]

CASES = [
    *_tma_cases("select_blocks_kernel", "selection", dict(LSE="fp32", BLOCKS="i32"),
                dict(T="i32", num_cmp="i32", scale="fp32"),
                dict(H=12, G=2, DK=64, BLOCK_DK=64, CMP_BLOCK=32, CMP_STRIDE=16, SEL_BLOCK=64, N_SELECT=16, N_INIT=1,
                     N_LOCAL=2, BLOCK_M=64, N_PAD=16, CHUNK_SPLITS=0, TOK_PAD=64, DOT_PRECISION="tf32"),
                descs=dict(QD=64, KCD=64)),
    *_tma_cases("range_attn_fwd_kernel", "range_attention", dict(LSE="fp32"), RANGE_SCALARS, dict(RANGE, HEADS=1),
                descs=dict(QD=64, KD=64, VD=64)),
    # both ranges with by_block's dQ slots summed in (nsa::core's backward), and one range without them
    *[c for two, slots in ((True, 16), (False, 0)) for c in _tma_cases(
        "range_attn_bwd_dq_kernel", "range_attention",
        dict(LSE2="fp32", DELTA2="fp32", SLOT_BLOCKS="i32", **ROW_TERMS),
        dict(num_keys2="i32", key_stride2="i32", key_offset2="i32", window2="i32", K2_ROW="i32", V2_ROW="i32",
             **RANGE_SCALARS),
        dict(RANGE, BLOCK_N=32, ACCUMULATE=False, TWO_RANGES=two, N_SLOTS=slots, HEADS=1,
             **({} if slots else dict(DQ_SLOTS=None, SLOT_BLOCKS=None))),
        dict(num_warps=4, num_stages=3), f"TWO_RANGES={two},N_SLOTS={slots}",
        descs=dict(QD=64, DOD=64, KD=32, VD=32, K2D=32, V2D=32))],
    # the forward and both ranges' dQ with two heads of a group a tile (HEADS: nsa-125m's 6 heads a group), the
    # query tiles through 3-D descriptors
    _case("range_attn_fwd_kernel", "range_attention",
          dict(LSE="fp32", QD="tensordesc<bf16[32, 2, 64]>", KD="tensordesc<bf16[64, 64]>",
               VD="tensordesc<bf16[64, 64]>"), RANGE_SCALARS, dict(RANGE, TMA=True, HEADS=2), label="HEADS=2"),
    _case("range_attn_bwd_dq_kernel", "range_attention",
          dict(LSE2="fp32", DELTA2="fp32", SLOT_BLOCKS="i32", **ROW_TERMS,
               **{d: "tensordesc<bf16[32, 2, 64]>" for d in ("QD", "DOD")},
               **{d: "tensordesc<bf16[32, 64]>" for d in ("KD", "VD", "K2D", "V2D")}),
          dict(num_keys2="i32", key_stride2="i32", key_offset2="i32", window2="i32", K2_ROW="i32", V2_ROW="i32",
               **RANGE_SCALARS),
          dict(RANGE, BLOCK_N=32, ACCUMULATE=False, TWO_RANGES=True, N_SLOTS=16, TMA=True, HEADS=2),
          dict(num_warps=4, num_stages=3), "HEADS=2"),
    # per head with atomic adds, in relative or absolute (ALIGNED_CHUNKS: its early return) chunks; per group, its
    # heads' loops one after the other, each query tile's heads in one loop, or in two passes of 3 (LOOP_HEADS)
    *[c for split, atomic, aligned, loop in ((6, True, False, 1), (6, True, True, 1), (1, False, False, 1),
                                             (1, False, False, 6), (1, False, False, 3)) for c in _tma_cases(
        "range_attn_bwd_dkdv_kernel", "range_attention", dict(ROW_TERMS, **(ACCS if atomic else {})),
        dict(q_chunk="i32", **RANGE_SCALARS),
        dict(RANGE, HEAD_SPLIT=split, ATOMIC=atomic, ALIGNED_CHUNKS=aligned, LOOP_HEADS=loop),
        dict(num_warps=4, num_stages=3),
        f"HEAD_SPLIT={split},ATOMIC={atomic},ALIGNED_CHUNKS={aligned}" + (f",LOOP_HEADS={loop}" if loop > 1 else ""),
        descs=dict(QD=64, DOD=64, KD=64, VD=64))],
    # alone, and with the gated sum in its epilogue (nsa::core's forward)
    *[c for gated in (False, True) for c in _tma_cases(
        "selected_attn_fwd_kernel", "selected_attention", dict(BLOCKS="i32", LSE="fp32"), SLC_SCALARS,
        dict(HEADS_PAD=8, GATED=gated, **SEL,
             **({} if gated else dict.fromkeys(("GATES", "O_CMP", "O_WIN", "O_GATED")))),
        dict(num_warps=2, num_stages=3), label=f"GATED={gated}", descs=dict(KD=64, VD=64))],
    *_tma_cases("selected_dq_from_ds_kernel", "selected_attention", dict(BLOCKS="i32"), dict(T="i32", K_ROW="i32"),
                dict({k: v for k, v in SEL.items() if k not in ("DV", "BLOCK_DV")}, HEADS_PAD=8, ACCUMULATE=True),
                dict(num_warps=2, num_stages=3), descs=dict(KD=64)),
    *_tma_cases("selected_attn_bwd_dq_kernel", "selected_attention", dict(BLOCKS="i32", **ROW_TERMS), SLC_SCALARS,
                dict(HEADS_PAD=8, ACCUMULATE=True, **SEL), dict(num_warps=2, num_stages=3), descs=dict(KD=64, VD=64)),
    _case("selected_attn_bwd_dkdv_kernel", "selected_attention",
          dict(QUERY_OF_ENTRY="i32", STARTS="i64", **ROW_TERMS, **ACCS), dict(num_blocks="i32", **SLC_SCALARS),
          dict({k: v for k, v in SEL.items() if k != "N_SELECT"}, HEADS_PAD=8, ENTRIES=8, CHUNK=256)),
    # alone, and with the gated sum in its epilogue (nsa::core's forward)
    *[c for gated in (False, True) for c in _tma_cases(
        "selected_tiled_fwd_kernel", "selected_tiled", dict(UNION="i32", COUNT="i32", MEMBERS="i64", LSE="fp32"),
        dict(num_tiles="i32", **SLC_SCALARS),
        dict(ROWS=64, TILE_Q=10, WIDTH_PAD=256, GATED=gated, **SEL,
             **({} if gated else dict.fromkeys(("GATES", "O_CMP", "O_WIN", "O_GATED")))),
        label=f"GATED={gated}", descs=dict(KD=64, VD=64))],
    *_tma_cases("selected_tiled_bwd_dq_kernel", "selected_tiled",
                dict(UNION="i32", COUNT="i32", MEMBERS="i64", **ROW_TERMS), dict(num_tiles="i32", **SLC_SCALARS),
                dict(ROWS=64, TILE_Q=10, WIDTH_PAD=256, ACCUMULATE=True, **SEL), descs=dict(KD=64, VD=64)),
    # the dQ from by_block's stored ds (slc_query_dq = "ds"), adding into the other branches' dQ
    *_tma_cases("selected_tiled_dq_from_ds_kernel", "selected_tiled",
                dict(UNION="i32", COUNT="i32", MEMBERS="i64", BLOCKS="i32"),
                dict(T="i32", num_tiles="i32", K_ROW="i32"),
                dict({k: v for k, v in SEL.items() if k not in ("DV", "BLOCK_DV")}, N_PAD=16, ROWS=64, TILE_Q=10,
                     ACCUMULATE=True), descs=dict(KD=64)),
    # OFFSETS_64 where a tensor passes int32 offsets (triton_impl._offsets_64)
    *[c for prefetch, wide in ((True, False), (False, False), (True, True)) for c in _tma_cases(
        "selected_block_fwd_kernel", "selected_by_block", dict(LSE2_PART="fp32", **BLOCK_INDEX),
        dict(num_blocks="i32", **SLC_SCALARS), dict(ROWS=64, CHUNK=512, PREFETCH=prefetch, OFFSETS_64=wide, **SEL),
        dict(num_warps=4, num_stages=3, **(dict(maxnreg=168) if prefetch else {})),
        f"PREFETCH={prefetch},OFFSETS_64={wide}", descs=dict(KD=64, VD=64))],
    # alone, and with the gated sum in its epilogue (nsa::core's forward)
    *[_case("selected_combine_kernel", "selected_by_block", dict(LSE2_PART="fp32", BLOCKS="i32", LSE="fp32"),
            dict(num_rows="i32"), dict(H=12, G=2, DV=64, BLOCK_DV=64, N_SELECT=16, BLOCK_R=32, GATED=gated,
                                       **({} if gated else dict.fromkeys(("GATES", "O_CMP", "O_WIN", "O_GATED")))),
            label=f"GATED={gated}") for gated in (True, False)],
    *[c for mode, prefetch, wide in ((0, False, False), (1, False, False), (2, False, False), (1, True, False),
                                     (0, True, False), (1, True, True), (3, False, False), (3, True, False))
      for c in _tma_cases(
        "selected_block_bwd_kernel", "selected_by_block", dict(BLOCK_INDEX, DONE="i32", **ROW_TERMS, **ACCS),
        dict(num_blocks="i32", **SLC_SCALARS),
        dict(ROWS=64, CHUNK=512, DQ_MODE=mode, PREFETCH=prefetch, OFFSETS_64=wide, **SEL),
        dict(num_warps=4, num_stages=3), f"DQ_MODE={mode},PREFETCH={prefetch},OFFSETS_64={wide}",
        descs=dict(KD=64, VD=64))],
    *[_case("selected_dq_sum_kernel", "selected_by_block", dict(BLOCKS="i32"), dict(num_rows="i32"),
            dict(H=12, G=2, DK=64, BLOCK_DK=64, N_SELECT=16, BLOCK_R=32, NUM_ADD=adds), label=f"NUM_ADD={adds}")
      for adds in (0, 1, 2)],
    _case("gated_sum_fwd_kernel", "gates", {}, dict(num_rows="i32"), dict(DV=64, BLOCK_R=32, BLOCK_D=64)),
    *[_case("gated_sum_bwd_kernel", "gates", GATES_BWD, dict(num_rows="i32"),
            dict(DV=64, BLOCK_R=32, BLOCK_D=64, FOLD=fold), label=f"FOLD={fold}") for fold in (True, False)],
    _case("row_dot_kernel", "delta", dict(DELTA="fp32"), dict(num_rows="i32"), dict(D=64, BLOCK_R=32, BLOCK_D=64)),
    _case("segment_ids_kernel", "block_index", dict(BLOCKS="i32", SEG="i16"),
          dict(num_entries="i32", T="i32", num_blocks="i32", num_segments="i32"), dict(G=2, N=16, BLOCK=1024)),
    _case("segment_starts_kernel", "block_index", dict(SORTED="i16", STARTS="i32"),
          dict(num_entries="i32", num_segments="i32"), dict(BLOCK=1024)),
    _case("block_work_kernel", "block_index", dict(STARTS="i32", WORK_SEG="i32", WORK_CHUNK="i32"),
          dict(num_segments="i32", num_work="i32"), dict(CHUNK=512, BLOCK_S=1024)),
    # the counting index at nsa-125m's 4 x 8k: 1024 slots a tile (64 queries of 16), 128 blocks, 128 tiles
    _case("tile_histogram_kernel", "block_index", dict(BLOCKS="i32", COUNTS="i32", TILE_TOTAL="i32"),
          dict(T="i32", num_blocks="i32", num_tiles="i32"), dict(G=2, N=16, N_PAD=16, ENTRIES=1024, NB_PAD=128)),
    _case("segment_offsets_kernel", "block_index",
          dict(COUNTS="i32", TILE_TOTAL="i32", OFFSETS="i32", STARTS="i32", WORK_SEG="i32", WORK_CHUNK="i32"),
          dict(num_blocks="i32", num_tiles="i32", num_groups="i32", work_per_group="i32"),
          dict(CHUNK=512, ROWS=32, NT_PAD=128, BLOCK_S=1024)),
    _case("tile_scatter_kernel", "block_index", dict(BLOCKS="i32", OFFSETS="i32", ORDER="i32"),
          dict(T="i32", num_blocks="i32", num_tiles="i32"), dict(G=2, N=16, N_PAD=16, ENTRIES=1024, ENTRY_BITS=10)),
    _case("tile_union_kernel", "block_index", dict(BLOCKS="i32", UNION="i32", COUNT="i32", MEMBERS="i64"),
          dict(T="i32", num_tiles="i32"),
          dict(G=2, N=16, N_PAD=16, TILE_Q=10, QUERIES=16, NB_PAD=32, WIDTH=160, BLOCK_W=256)),
    *[_case("rope_split_kernel", "rope", dict(COS="fp32", SIN="fp32", POS="i64", PARTS=["bf16"] * 8),
            dict(num_tokens="i32", T="i32", y_sb="i32", y_st="i32", **{f"part_s{d}": ["i32"] * 8 for d in "bth"}),
            dict(NSA_PARTS, INVERSE=inverse, AT_POS=at_pos, TO_POS=[False] + [at_pos] * 6 + [False], BLOCK_T=8),
            label=f"INVERSE={inverse},AT_POS={at_pos}")
      for inverse, at_pos in ((False, False), (True, False), (False, True))],  # AT_POS: a decoding step's
    _case("attention_stats_kernel", "stats", dict(BLOCKS="i32", PARTS="fp32"),
          dict(num_tokens="i32", T="i32", tokens_per_program="i32"),
          dict(SLOTS=32, SLOTS_PAD=32, GATE_COLS=36, GATE_PAD=64, SEL_BLOCK=64, TOKENS=32)),
    # phi = mlp (nsa::phi_mlp) at nsa-125m's l = 32, d = 16, hidden 128
    _case("phi_fwd_kernel", "compress", dict(BIAS1="fp32", W2="fp32", B2="fp32", HS="fp32"),
          dict(R="i32", TC="i32", x_sb="i32", x_st="i32", x_sg="i32"), dict(PHI, L=32, STRIDE=16, BLOCK_R=32), PHI_RUN),
    _case("phi_bwd_rows_kernel", "compress", dict(HS="fp32", W2="fp32", SUMS="fp32"), dict(R="i32"),
          dict(PHI, BLOCK_R=32), PHI_RUN),
    _case("phi_bwd_w1_kernel", "compress", dict(DW1="fp32"),
          dict(R="i32", TC="i32", tiles_per_split="i32", x_sb="i32", x_st="i32", x_sg="i32"),
          dict(PHI, L=32, STRIDE=16, BLOCK_R=64), PHI_RUN),
    _case("phi_bwd_x_kernel", "compress", {}, dict(T="i32", TC="i32", NCH="i32", NUM_ROWS="i32"),  # W1 in bf16
          dict(PHI, STRIDE=16, PIECES=2, BLOCK_R=64, OFFSETS=16), PHI_RUN),
    # the decoding step (outside the core), nsa-125m at 8k positions: 6 heads a group padded to 8 rows
    *[_case(name, "decode", pointers, {**{s: "i32" for s in strides}, **scalars}, dict(DECODE, **constexprs),
            label=f"NB_PAD={constexprs['NB_PAD']},SEGMENT={constexprs['SEGMENT']}" if "SEGMENT" in constexprs else "")
      for name, pointers, strides, scalars, constexprs in DECODE_CASES],
]



# An atomic instruction of the PTX: its memory-order semantics and what it adds.
ATOMIC = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.global\.(?:gpu\.)?(\w+)\.add(?:\.v\d)?\.(\w+)", re.M)


def float_add_semantics(ptx: str) -> list[str]:
    """The semantics of every floating-point atomic add in a kernel's PTX."""
    return [sem for sem, kind in ATOMIC.findall(ptx) if kind.startswith("f")]


def adds_floats_atomically(name: str, constexprs: dict) -> bool:
    """Whether a kernel case accumulates into float32 by atomic adds: the range dK/dV where its programs meet
    (ATOMIC), the inverted selected dK/dV, and by_block's backward (its accumulators, and its dQ in DQ_MODE 2).
    The semantics check below is empty for every other kernel; this says where it must find adds."""
    return (name in ("selected_attn_bwd_dkdv_kernel", "selected_block_bwd_kernel")
            or name == "range_attn_bwd_dkdv_kernel" and constexprs["ATOMIC"])


def test_float_add_semantics_reads_ptx():
    ptx = ("\t@%p239 atom.global.gpu.acq_rel.add.v4.f32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ], { %r5, %r6, %r7, %r8 };\n"
           "\t@%p3 atom.global.gpu.relaxed.add.f32 %r9, [ %rd2 + 0 ], %r10;\n"
           "\t@%p4 atom.global.gpu.acq_rel.add.u32 %r11, [ %rd3 + 0 ], 1;\n"
           "\t@%p11 cp.async.ca.shared.global [ %r1043 + 0 ], [ %rd18 + 0 ], 0x4, %r77;\n")
    assert float_add_semantics(ptx) == ["acq_rel", "relaxed"]


@pytest.mark.parametrize("module, name, pointers, scalars, constexprs, options", CASES)
def test_kernel_compiles_for_hopper(module, name, pointers, scalars, constexprs, options, tmp_path):
    """Compiles, and every floating-point atomic add is relaxed. The adds accumulate sums that later kernels read,
    or that a program reads after a barrier and an acquire-release count (selected_block_bwd_kernel); at
    tl.atomic_add's default, acq_rel, each one is fenced (MEMBAR.ALL.GPU around every ATOMG in the SASS), which
    the compressed dK/dV's counters showed as memory-barrier stalls (kernels-notes.md, v51)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    spec = json.dumps([module, name, pointers, scalars, constexprs, options, [], False])
    ptx = tmp_path / "kernel.ptx"
    run = subprocess.run([sys.executable, "-c", COMPILE, spec, str(ptx)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) > 0  # a cubin of some bytes
    semantics = float_add_semantics(ptx.read_text())
    assert bool(semantics) == adds_floats_atomically(name, constexprs), semantics  # the check below is not vacuous
    assert all(sem == "relaxed" for sem in semantics), semantics
