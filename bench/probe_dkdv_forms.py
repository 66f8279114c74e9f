"""Probe (agreement and timing): the compressed branch's dK/dV kernel in other forms of its per-tile step.

    python bench/probe_dkdv_forms.py [--shapes paper:1:65536,...] [--variants S:4:2:64:64 STR:4:3:32:64 ...]
        --out DIR --commit SHA

Why (kernels-notes.md v85): in the sm_90 code of the kernel as it is (form S: S = Q K^T, a query per row), both
score products take both operands from shared memory, the streamed q or dO tile on the left and the key tile on the
right, and P and dS go through shared memory to be transposed for dV += P^T dO and dK += dS^T Q. That is about 160
KB of shared-memory traffic a 64 x 64 step for 1,024 cycles of matrix work, above the 128 bytes a cycle a
multiprocessor's shared memory serves. The dQ kernel holds its loop-invariant q and dO in registers as the left
operands of its score products and reaches 79% of the matrix units where the dK/dV reaches 56%.
The variants edit kernels/range_attention.py's `_dkdv_step` (bench/kernel_variants.py):
- S: the kernel as it is;
- ST: S^T = K Q^T, a key per row: P^T and dS^T are dV's and dK's left operands as they stand (no transposes); the
  key and value tiles stay in shared memory (v21, v66 measured this form, 4-52% slower);
- STR: ST with the key and value tiles held in registers as the left operands of S^T = K Q^T and dP^T = V dO^T,
  so that each product reads only its streamed tile from shared memory (the kernel masks the tiles' rows past the
  keys, which makes them register values; a TMA load feeding a product directly stays in shared memory);
- S-tma-rows, ST-tma-rows: S or ST with each step's lse and delta through the tensor memory accelerator from
  [B * H, T] copies (ROW_TERMS_TMA; the copies are made inside the timing). In ST the kernel as it is loads them
  with cp.async, a value per query column and thread, into one buffer fenced by block barriers: v85's stall
  ledger of ST put a third of its warps' samples on those barriers and the address arithmetic.
A variant is FORM:warps:stages:query tile:key tile. Per shape, GPU ms (median of CUDA-event timings, the kernel
alone with its float32 accumulators' zero fill, as probe_cmp_dq.py times it). Before timing, each variant's dK and
dV are compared with the kernel as it is (bf16 inputs, float32 sums).
Writes DIR/probe-<device>-<date><suffix>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.kernel_variants import edited_module  # noqa: E402
from bench.probe_cmp_dq import gpu_ms, launch_cmp_dkdv, make_inputs, rel_err  # noqa: E402
from bench.provenance import file_suffix, git_commit  # noqa: E402
from bench.shapes import FAMILIES, family_shapes  # noqa: E402

S_FORM = """    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
        vis = _visible(offs_m, offs_n, key_stride, key_offset, window) & n_ok[None, :] & m_ok[:, None]
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    else:
        p = tl.exp2(s - lse2[:, None])  # every query of a full tile sees a key: its lse is finite
    dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=DOT_PRECISION)
"""
ST_FORM = """    st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
        rel = offs_m[None, :] - (offs_n[:, None] * key_stride + key_offset)
        vis = (rel >= 0) & (rel < window) & n_ok[:, None] & m_ok[None, :]
        pt = tl.where(vis, tl.exp2(st - lse2[None, :]), 0.0)
    else:
        pt = tl.exp2(st - lse2[None, :])
    dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
"""
KEY_TILE = """                     BLOCK_N, True, TMA)
    if EDGE_SPLIT:
        # Full query tiles"""
KEY_TILE_IN_REGISTERS = """                     BLOCK_N, True, TMA)
    k = tl.where(n_ok[:, None], k, 0.0)
    v = tl.where(n_ok[:, None], v, 0.0)
    if EDGE_SPLIT:
        # Full query tiles"""
# The row terms (lse, delta) of each step through the tensor memory accelerator, from [B * H, T] copies whose
# queries are contiguous (LSED, DELTAD): one copy a step into a buffer the pipeline rotates, where the kernel as it
# is loads them with cp.async into one buffer, fenced by block barriers, a value per query and thread in form ST.
ROW_TERMS = """    if MASKED:
        lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0) * LOG2E
        delta = tl.load(DELTA + row_q, mask=m_ok, other=0.0)
    else:  # a full query tile lies inside [0, num_queries)
        lse2 = tl.load(LSE + row_q) * LOG2E
        delta = tl.load(DELTA + row_q)
"""
ROW_TERMS_TMA = """    lse2 = tl.reshape(LSED.load([b * H + h, start_m]), [BLOCK_M]) * LOG2E
    delta = tl.reshape(DELTAD.load([b * H + h, start_m]), [BLOCK_M])
"""
TMA_ROWS = [
    (ROW_TERMS, ROW_TERMS_TMA),
    ("               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):\n"
     "    \"\"\"dk, dv plus the key tile's share from the query tile start_m.. of head h.\"\"\"",
     "               TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, LSED=None, DELTAD=None):\n"
     "    \"\"\"dk, dv plus the key tile's share from the query tile start_m.. of head h.\"\"\""),
    ("TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1):",
     "TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS: tl.constexpr = 1, LSED=None,\n                DELTAD=None):"),
    ("BLOCK_M, MASKED, TMA, DOT_PRECISION)", "BLOCK_M, MASKED, TMA, DOT_PRECISION, LSED, DELTAD)"),
    ("LOOP_HEADS: tl.constexpr = 1):", "LOOP_HEADS: tl.constexpr = 1, LSED=None, DELTAD=None):"),
    ("TMA, DOT_PRECISION, LOOP_HEADS)\n", "TMA, DOT_PRECISION, LOOP_HEADS, LSED, DELTAD)\n"),
]
ST = [(S_FORM, ST_FORM)]
FORMS = {"S": [], "ST": ST, "STR": ST + [(KEY_TILE, KEY_TILE_IN_REGISTERS)], "S-tma-rows": TMA_ROWS,
         "ST-tma-rows": ST + TMA_ROWS}

_MODULES: dict = {}


def variant(name: str, edits):
    """The range-attention module with `edits` applied (None where an edit's text is not in the source)."""
    return edited_module("range_attention.py", name, edits)


def form_module(form: str):
    """kernels/range_attention.py itself (S) or edited into the form, built once per form."""
    if form == "S":
        from nsa_model.kernels import range_attention
        return range_attention
    if form not in _MODULES:
        module = variant(form, FORMS[form])
        if module is None:
            raise SystemExit(f"the {form} edits no longer apply to kernels/range_attention.py")
        _MODULES[form] = module
    return _MODULES[form]


def parse_variant(text: str) -> tuple:
    """FORM:warps:stages:query tile:key tile."""
    parts = text.split(":")
    if len(parts) != 5 or parts[0] not in FORMS or not all(p.isdigit() for p in parts[1:]):
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected FORM ({', '.join(FORMS)}):warps:stages:"
                                         "query tile:key tile")
    warps, stages, block_m, block_n = (int(p) for p in parts[1:])
    if warps not in (4, 8) or stages < 1:
        raise argparse.ArgumentTypeError(f"variant {text!r}: warps 4 or 8, stages >= 1")
    return parts[0], warps, stages, block_m, block_n


def dkdv(inputs: dict, case: tuple):
    """(dk, dv) of the compressed branch by the variant's kernel."""
    form, warps, stages, block_m, block_n = case
    extra = {}
    if form.endswith("-tma-rows"):
        from triton.tools.tensor_descriptor import TensorDescriptor

        B, T, H, _ = inputs["q"].shape
        for arg, name in (("LSED", "lse_cmp"), ("DELTAD", "delta_cmp")):
            rows = inputs[name].permute(0, 2, 1).reshape(B * H, T).contiguous()  # timed with the kernel
            extra[arg] = TensorDescriptor(rows, [B * H, T], [T, 1], [1, block_m])
    return launch_cmp_dkdv(form_module(form), inputs, warps, stages, (block_m, block_n), extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="paper:1:65536,paper:1:32768,paper:1:8192")
    ap.add_argument("--variants", type=parse_variant, nargs="+",
                    default=[parse_variant(v) for v in ("S:4:2:64:64", "S-tma-rows:4:2:64:64", "ST:4:2:64:64",
                                                        "ST-tma-rows:4:2:64:64", "STR:4:2:32:64")])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--suffix", type=file_suffix, default="")
    args = ap.parse_args()
    import torch

    from bench.kernel_variants import write_times

    commit = args.commit or git_commit()
    results, errors = {}, []
    for family, b, t in family_shapes(args.shapes):
        spec = f"{family}:{b}:{t}"
        x = make_inputs(b, t, **FAMILIES[family])
        dk_ref, dv_ref = dkdv(x, ("S", 4, 2, 64, 64))
        row = {}
        for case in args.variants:
            name = ":".join(map(str, case))
            try:
                dk, dv = dkdv(x, case)
            except Exception as e:  # e.g. out of shared memory at these tiles: that variant is out
                print(f"{spec} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                row[name] = float("nan")
                continue
            errs = rel_err(dk, dk_ref), rel_err(dv, dv_ref)
            errors.append(f"{spec} {name}: rel err dK {errs[0]:.1e}, dV {errs[1]:.1e}")
            print(errors[-1], flush=True)
            if max(errs) > 2e-2:
                raise SystemExit(f"{spec} {name}: disagrees with the kernel as it is ({errs})")
            row[name] = gpu_ms(lambda: dkdv(x, case), args.reps)
            print(f"{spec} {name}: {row[name]:.3f} ms", flush=True)
        results[spec] = row
        x = None  # free the inputs before the next shape
        torch.cuda.empty_cache()
    note = ("GPU ms, median of CUDA-event timings, the compressed dK/dV kernel alone; a variant is FORM:warps:"
            "stages:query tile:key tile (S:4:2:64:64 = the kernel as nsa::core runs it at head dim 128).\n\n"
            "Agreement with the kernel as it is: " + "; ".join(errors))
    stem = write_times(args.out, args.suffix, commit, results, title="the compressed dK/dV's step forms",
                       note=note, unit="ms", fmt=".3f")
    print("wrote", stem)


if __name__ == "__main__":
    main()
