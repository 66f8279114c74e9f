"""Probe (timing only) of how much the attention kernels wait on the exponential unit, and what moving part of
their exponentials onto the FMA pipe gives back (kernels-notes.md v34).

    python bench/probe_exp2.py --out DIR [--commit SHA] [--suffix=-v34a] [--shapes 125m:4:8192,paper:1:8192]
    python bench/probe_exp2.py --selection --out DIR ...   # the selection kernel alone, as it is and as it was

On Hopper each multiprocessor computes 16 exponentials a clock (MUFU.EX2; a half-precision pair is two of them:
sm_90 has no packed form) against 128 fp32 FMAs. At head dim 64 one 64 x 64 tile of scores costs as many clocks
of exponentials as of matrix work (4096 / 16 = 256 against 2 x 64^3 / 2048 = 256), so the exponential can bound
the forward kernels. FlashAttention-4's device: evaluate some of them as 2^n * p(f) on the FMA pipe, n = round(x),
f = x - n, p a polynomial.

Variants of every kernel module that exponentiates (range, by_block, tiled, per-query, selection), built by editing
their source (kernel_variants.py): each `tl.exp2(x)` of a 2-D tile (at c3ad191, where it was first run, the
selection's `tl.exp`; since v34 the selection has an exp2 too) becomes

- "no exp": x itself (the results are wrong: what the kernels would take without the unit, a bound);
- "fma half d4": every second column through a degree-4 polynomial (relative error 2.9e-6), the rest MUFU;
- "fma quarter d4": a quarter of the columns that way;
- "fma half d3": half, degree 3 (1.0e-4, enough for bf16 probabilities only).

For each variant and shape: NSA's core forward + backward as a CUDA graph (ms), its kernels' GPU times
(torch.profiler), and the output's and gradients' largest difference from the production kernels' (relative to
the largest value), a check that the polynomial variants compute what the production ones do.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.kernel_variants import KERNELS, edited_module  # noqa: E402
from bench.kernels import PAPER_NSA, SHAPES, bench_graph, kernel_breakdown, make_inputs  # noqa: E402
from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402
from bench.shapes import family_shapes  # noqa: E402
from nsa_model.ops import triton_impl as ti  # noqa: E402

MODULES = {  # kernel module -> the kernels of it that triton_impl launches
    "range_attention.py": ("range_attn_fwd_kernel", "range_attn_bwd_dq_kernel", "range_attn_bwd_dkdv_kernel"),
    "selected_by_block.py": ("selected_block_fwd_kernel", "selected_block_bwd_kernel", "selected_combine_kernel"),
    "selected_tiled.py": ("selected_tiled_fwd_kernel", "selected_tiled_bwd_dq_kernel"),
    "selected_attention.py": ("selected_attn_fwd_kernel", "selected_attn_bwd_dq_kernel",
                              "selected_attn_bwd_dkdv_kernel"),
    "selection.py": ("select_blocks_kernel",),
}
IMPORT = "import triton.language as tl\n"

FMA = """
@triton.jit
def _exp2_fma_v(x):
    # 2^x = 2^n * p(f), n = round(x), f = x - n in [-0.5, 0.5]; adding 1.5 * 2^23 rounds x into the low mantissa
    # bits, whence n << 23 is added to p's exponent bits. p(0) = 1 exactly, so x <= -127 (and -inf) gives +0.
    x = tl.maximum(x, -127.0)
    j = x + 12582912.0
    f = x - (j - 12582912.0)
    p = {poly}
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)
"""
POLY = {4: "(((0.009582852944731712 * f + 0.055906426161527634) * f + 0.24024099111557007) * f "
           "+ 0.6931241750717163) * f + 1.0",
        3: "((0.05500892922282219 * f + 0.2422109693288803) * f + 0.6932829022407532) * f + 1.0"}
HALF = """
@triton.jit
def _exp2_v(x):
    if len(x.shape) == 2:
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        a, b = tl.split(tl.reshape(x, [M, N // 2, 2]))  # a thread's register pairs: no data moves
        return tl.reshape(tl.join(tl.exp2(a), _exp2_fma_v(b)), [M, N])
    else:
        return tl.exp2(x)
"""
QUARTER = """
@triton.jit
def _exp2_v(x):
    if len(x.shape) == 2:
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        left, right = tl.split(tl.permute(tl.reshape(x, [M, 2, N // 2]), (0, 2, 1)))
        a, b = tl.split(tl.reshape(right, [M, N // 4, 2]))
        right = tl.reshape(tl.join(tl.exp2(a), _exp2_fma_v(b)), [M, N // 2])
        return tl.reshape(tl.permute(tl.join(tl.exp2(left), right), (0, 2, 1)), [M, N])
    else:
        return tl.exp2(x)
"""
NONE = """
@triton.jit
def _exp2_v(x):
    return x
"""
VARIANTS = {"prod": None, "no exp": NONE, "fma half d4": FMA.format(poly=POLY[4]) + HALF,
            "fma quarter d4": FMA.format(poly=POLY[4]) + QUARTER, "fma half d3": FMA.format(poly=POLY[3]) + HALF}


def edits(helpers: str, module: str) -> list[tuple[str, str]]:
    """The module's edits: the helpers after its imports, its exponentials through _exp2_v."""
    src = (KERNELS / module).read_text()
    out = [("tl.exp2(", "_exp2_v(")] if "tl.exp2(" in src else []
    return out + [(IMPORT, IMPORT + helpers)]  # last: the helpers' own tl.exp2 stays the unit's


def kernels_of(name: str) -> dict:
    """ti's kernel name -> the variant's kernel (the production ones for "prod")."""
    if VARIANTS[name] is None:
        return {k: getattr(ti, k) for ks in MODULES.values() for k in ks}
    out = {}
    for module, names in MODULES.items():
        mod = edited_module(module, f"{name}-{module}", edits(VARIANTS[name], module))
        if mod is None:
            raise SystemExit(f"probe_exp2: an edit of {module} no longer finds its text")
        out.update({k: getattr(mod, k) for k in names})
    return out


def run_shape(family: str, B: int, T: int, variants: dict) -> dict:
    s = SHAPES[family]
    H, G, Dk, Dv = s["H"], s["G"], s["Dk"], s["Dv"]
    cfg, scale = PAPER_NSA, Dk ** -0.5
    x = make_inputs(B, T, H, G, Dk, Dv, cfg, torch.bfloat16, seed=1)
    leaves = [t.requires_grad_() for t in x.values()]
    do = torch.randn(B, T, H, Dv, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd():
        ti.nsa_attention(*leaves, cfg, scale=scale).backward(do)

    def outputs():
        for t in leaves:
            t.grad = None
        o = ti.nsa_attention(*leaves, cfg, scale=scale)
        o.backward(do)
        return [o.detach().float()] + [t.grad.float() for t in leaves]

    prod = kernels_of("prod")
    row, ref = {}, None
    try:
        for name, kernels in variants.items():
            for k, fn in kernels.items():
                setattr(ti, k, fn)
            got = outputs()
            if ref is None:
                ref = got
            diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(got, ref))
            graph_ms = bench_graph(fwd_bwd, leaves)
            for t in leaves:
                t.grad = None
            row[name] = {"graph_ms": graph_ms, "max_rel_diff": diff, "kernels_ms": kernel_breakdown(fwd_bwd, top=14)}
            print(family, B, T, name, round(graph_ms, 3), "ms", f"diff {diff:.2e}", flush=True)
    finally:
        for k, fn in prod.items():
            setattr(ti, k, fn)
    return row


LSE_LOAD = "lse2 = tl.load(LSE + row_q, mask=m_ok, other=0.0)"
OLD_EXP = [(LSE_LOAD + " * LOG2E", LSE_LOAD), ("* (scale * LOG2E)", "* scale"),  # the selection before v34
           ("tl.exp2(s2 - lse2[:, None])", "tl.exp(s2 - lse2[:, None])")]
# v35: the visibility mask once per chunk instead of per head, and the importance as a banded sum instead of the
# fp32 [tokens x blocks] matmul; these edits put back what the kernel did before (the mask in the head loop, and
# the matmul, which stays the kernel's path where l'/d is not a power of 2)
PER_HEAD_MASK = [("p_sum += tl.exp2(s2 - lse2[:, None])", "p_sum += tl.where(vis, tl.exp2(s2 - lse2[:, None]), 0.0)")]
MATMUL_IMPORTANCE = [("BANDED: tl.constexpr = TOK_PAD == TOKENS_PER_CHUNK", "BANDED: tl.constexpr = False")]
SELECTION_VARIANTS = {"as it is (v35)": [], "before v35 (mask per head, matmul)": PER_HEAD_MASK + MATMUL_IMPORTANCE,
                      "mask per head": PER_HEAD_MASK, "matmul importance": MATMUL_IMPORTANCE,
                      "tl.exp (before v34)": PER_HEAD_MASK + MATMUL_IMPORTANCE + OLD_EXP,
                      "fma quarter d4": [("tl.exp2(", "_exp2_v("), (IMPORT, IMPORT + VARIANTS["fma quarter d4"])]}


def selection_variant(name: str):
    edits_ = SELECTION_VARIANTS[name]
    mod = edited_module("selection.py", f"sel-{name}", edits_) if edits_ else None
    if edits_ and mod is None:
        raise SystemExit(f"probe_exp2: an edit of selection.py for {name!r} no longer finds its text")
    return mod.select_blocks_kernel if mod else ti.select_blocks_kernel


def time_selection(family: str, B: int, T: int) -> dict:
    """The selection kernel alone, as it is and as each edited variant, ms as a CUDA graph, and the share of
    (query, group) rows whose selected set differs from the kernel's as it is."""
    s = SHAPES[family]
    H, G, Dk = s["H"], s["G"], s["Dk"]
    cfg, scale = PAPER_NSA, Dk ** -0.5
    x = make_inputs(B, T, H, G, Dk, s["Dv"], cfg, torch.bfloat16, seed=1)
    _, lse = ti.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], cfg, scale)
    out, base, prod = {}, None, ti.select_blocks_kernel
    try:
        for name in SELECTION_VARIANTS:
            ti.select_blocks_kernel = selection_variant(name)
            blocks = ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale).sort(-1).values
            base = blocks if base is None else base
            ms = triton.testing.do_bench_cudagraph(lambda: ti.select_blocks(x["q"], x["k_cmp"], lse, cfg, scale),
                                                   rep=200)
            rows_differing = float((blocks != base).any(-1).float().mean())
            out[name] = {"ms": ms, "rows_differing": rows_differing}
            print(family, B, T, name, f"{ms * 1000:.1f} us", f"rows differing {rows_differing:.2e}", flush=True)
    finally:
        ti.select_blocks_kernel = prod
    return out


def write_selection(out_dir: pathlib.Path, suffix: str, commit: str, results: dict) -> pathlib.Path:
    stem, meta = result_stem(out_dir, "probe", suffix, commit)
    device = meta["device"]
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "selection": results}, indent=1))
    names = list(SELECTION_VARIANTS)
    lines = [f"# Probe: the selection kernel as it is and as it was: {device}, {meta['date']}", "",
             f"commit {commit}, torch {meta['torch']}, triton {meta['triton']}. `bench/probe_exp2.py --selection`: "
             "select_blocks_kernel alone (`do_bench_cudagraph` median, us), bf16, random inputs, as it is and as "
             "variants edited from it: before v35 (the visibility mask applied per head, the importance as an "
             "fp32 matmul), each of those two alone, the `tl.exp(s - lse)` it had before v34, and a quarter of its "
             "exponentials as a degree-4 polynomial on the FMA pipe. In brackets the share of (query, group) rows "
             "whose set differs from the kernel's as it is (near-ties).", "",
             "| shape | " + " | ".join(names) + " | before / as it is |", "|---|" + "---|" * (len(names) + 1)]
    for shape, row in results.items():
        cells = [f"{row[k]['ms'] * 1000:.1f} ({row[k]['rows_differing']:.1e})" for k in names]
        ratio = row[names[1]]["ms"] / row[names[0]]["ms"]
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    result_file(stem, ".md").write_text("\n".join(lines) + "\n")
    return stem


def write(out_dir: pathlib.Path, suffix: str, commit: str, results: dict) -> pathlib.Path:
    stem, meta = result_stem(out_dir, "probe", suffix, commit)
    device = meta["device"]
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "shapes": results}, indent=1))
    lines = [f"# Probe: the exponential unit in the attention kernels: {device}, {meta['date']}", "",
             f"commit {commit}, torch {meta['torch']}, triton {meta['triton']}. `bench/probe_exp2.py`: NSA core "
             "forward + backward as a CUDA graph (`do_bench_cudagraph` median, ms), bf16, random inputs; "
             "\"no exp\" gives wrong results (a bound). diff: the largest difference of the output and gradients "
             "from prod's, relative to prod's largest value.", ""]
    for shape, row in results.items():
        names = list(row)
        lines += [f"## {shape}", "", "| kernel | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines.append("| **whole call (graph)** | " + " | ".join(f"**{row[n]['graph_ms']:.3f}**" for n in names) + " |")
        lines.append("| diff | " + " | ".join(f"{row[n]['max_rel_diff']:.1e}" for n in names) + " |")
        kernels = [k for k in row[names[0]]["kernels_ms"] if k != "(others)"]
        for k in kernels + ["(others)"]:
            lines.append(f"| {k} | " + " | ".join(f"{row[n]['kernels_ms'].get(k, float('nan')):.3f}" for n in names)
                         + " |")
        lines.append("")
    result_file(stem, ".md").write_text("\n".join(lines))
    return stem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--suffix", type=file_suffix, default="-exp2")
    parser.add_argument("--shapes", type=lambda text: family_shapes(text, SHAPES),
                        default="125m:4:8192,125m:16:2048,125m:1:32768,paper:1:8192")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--selection", action="store_true", help="only the selection kernel: as it is, as it was "
                        "before v35 and v34, and with its exponentials partly on the FMA pipe")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.selection:
        results = {}
        for family, B, T in args.shapes:
            results[f"{family} {B} x {T}"] = time_selection(family, B, T)
        print(write_selection(out_dir, args.suffix, args.commit or git_commit(), results))
        return
    names = args.variants.split(",")
    variants = {name: kernels_of(name) for name in ["prod"] + [n for n in names if n != "prod"]}
    results = {}
    for family, B, T in args.shapes:
        results[f"{family} {B} x {T}"] = run_shape(family, B, T, variants)
        write(out_dir, args.suffix, args.commit or git_commit(), results)
    print(write(out_dir, args.suffix, args.commit or git_commit(), results))


if __name__ == "__main__":
    main()
