"""Probe (timing only, not a check) of the small NSA-only pieces of the T = 8192 step (kernels-notes.md v32).

    python bench/probe_v32.py --out FILE.json [--sections selection,index,phi]

1. select_blocks_kernel and variants of it built by editing its source: without its sorts, without the merge,
   without the exponential. The variants' selections are wrong by construction; only their times matter.
2. The by_block index (block_work) as a whole, and the radix sort of its segment keys alone.
3. phi = mlp, forward and backward of k and v: two launches of G groups, one launch of 2G groups (what one paired
   launch costs at best), nsa::phi_mlp of two sets (phi_mlp_pair, where the tree has it), phi_rows 16 and 64.

Run from a tree and from a copy of another commit's tree in the same call, it gives A/Bs of one run
(`probe-h200-2026-11-25-v32{a,b}*.md`). Times are do_bench_cudagraph medians (ms in the JSON).
"""

import argparse
import dataclasses
import json
import pathlib

import torch
import triton
from triton.testing import do_bench_cudagraph

from bench.kernel_variants import edited_module
from nsa_model.config import NSAConfig
from nsa_model.ops import triton_impl as ti

SHAPES = {"125m 4x8k": (4, 8192, 12, 2, 64), "125m 16x2k": (16, 2048, 12, 2, 64),
          "125m 1x32k": (1, 32768, 12, 2, 64), "paper 1x8k": (1, 8192, 64, 4, 128),
          "paper 1x64k": (1, 65536, 64, 4, 128)}  # B, T, H, G, D
MERGE = "top = _merge_descending(tl.maximum(top, chunk_top), BLOCK_M, N_PAD)"
SELECT_EDITS = {  # each variant's edits of kernels/selection.py as it is now (the base tree's variants: v32a.md)
    "prod": [],
    "no sorts": [("chunk_top = tl.sort(key, dim=1)", "chunk_top = key"), (MERGE, "top = tl.maximum(top, chunk_top)")],
    "no merge": [(MERGE, "top = tl.maximum(top, chunk_top)")],
    "no exp": [("p_sum += tl.exp2(s2 - lse2[:, None])", "p_sum += s2 - lse2[:, None]")],
}


def variant(name: str, edits):
    module = edited_module("selection.py", name, edits)
    return None if module is None else module.select_blocks_kernel


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=200)


def probe_selection(out: dict) -> None:
    cfg = NSAConfig()
    kernels = {name: variant(name, edits) for name, edits in SELECT_EDITS.items()}
    kernels = {name: kernel for name, kernel in kernels.items() if kernel is not None}
    prod = ti.select_blocks_kernel
    for shape, (B, T, H, G, D) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        tc = cfg.num_cmp_tokens(T)
        kc = torch.randn(B, tc, G, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(B, tc, G, D, device="cuda", dtype=torch.bfloat16)
        scale = D ** -0.5
        _, lse = ti._range_fwd(q, kc, vc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
        row = {}
        for name, kernel in kernels.items():
            ti.select_blocks_kernel = kernel
            try:
                row[name] = bench(lambda: ti.select_blocks(q, kc, lse, cfg, scale))
            finally:
                ti.select_blocks_kernel = prod
        for warps in (8,):
            bm, splits, _ = ti.select_launch(D)
            with ti.use_launch_config(dataclasses.replace(ti.launch_config(), select_d128=(bm, splits, warps),
                                                          select_d64=(bm, splits, warps))):
                row[f"prod, {warps} warps"] = bench(lambda: ti.select_blocks(q, kc, lse, cfg, scale))
        out["selection"][shape] = row
        print(shape, {k: round(v * 1000, 1) for k, v in row.items()}, "us", flush=True)


def probe_index(out: dict) -> None:
    cfg = NSAConfig()
    for shape, (B, T, H, G, D) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        tc = cfg.num_cmp_tokens(T)
        kc, vc = (torch.randn(B, tc, G, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = D ** -0.5
        _, lse = ti._range_fwd(q, kc, vc, *ti._cmp_range(cfg.cmp_block, cfg.cmp_stride, T), scale)
        blocks = ti.select_blocks(q, kc, lse, cfg, scale)
        nb = triton.cdiv(T, cfg.sel_block)
        row = {"index (block_work)": bench(lambda: ti.block_work(blocks, nb, ti.launch_config().slc_block_chunk)),
               "index: segment ids + sort": bench(lambda: ti._sorted_segments(blocks, nb))}
        out["index"][shape] = row
        print(shape, {k: round(v * 1000, 1) for k, v in row.items()}, "us", flush=True)


def phi_step(x, w, dy):
    y = ti.phi_mlp(x, *w, 32, 16)
    return torch.autograd.grad(y, [x, *w], dy)


def pair_step(xk, xv, wk, wv, dyk, dyv):
    yk, yv = ti.phi_mlp_pair(xk, xv, wk, wv, 32, 16)
    return torch.autograd.grad([yk, yv], [xk, xv, *wk, *wv], [dyk, dyv])


def probe_phi(out: dict) -> None:
    for shape, (B, T, H, G, D) in list(SHAPES.items())[:3]:
        hidden = 2 * D
        torch.manual_seed(0)

        def make(groups):
            x = torch.randn(B, T, groups, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = [torch.randn(hidden, 32 * D, device="cuda") * 0.02, torch.zeros(hidden, device="cuda"),
                 torch.randn(D, hidden, device="cuda") * 0.02, torch.zeros(D, device="cuda")]
            w = [t.requires_grad_() for t in w]
            tc = (T - 32) // 16 + 1
            dy = torch.randn(B, tc, groups, D, device="cuda", dtype=torch.bfloat16)
            return x, w, dy

        xk, wk, dyk = make(G)
        xv, wv, dyv = make(G)
        x2, w2, dy2 = make(2 * G)
        row = {"k and v apart (2 x G groups)": bench(lambda: (phi_step(xk, wk, dyk), phi_step(xv, wv, dyv))),
               "one launch of 2G groups": bench(lambda: phi_step(x2, w2, dy2)),
               **({"phi_mlp_pair": bench(lambda: pair_step(xk, xv, wk, wv, dyk, dyv))}
                  if hasattr(ti, "phi_mlp_pair") else {}),
               "forward only, apart": bench(lambda: (ti.phi_mlp(xk, *wk, 32, 16), ti.phi_mlp(xv, *wv, 32, 16))),
               "forward only, 2G": bench(lambda: ti.phi_mlp(x2, *w2, 32, 16))}
        for rows in (16, 64):
            with ti.use_launch_config(dataclasses.replace(ti.launch_config(), phi_rows=rows)):
                row[f"apart, phi_rows={rows}"] = bench(lambda: (phi_step(xk, wk, dyk), phi_step(xv, wv, dyv)))
        out["phi"][shape] = row
        print(shape, {k: round(v * 1000, 1) for k, v in row.items()}, "us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="selection,index,phi")
    args = parser.parse_args()
    out = {"device": torch.cuda.get_device_name(), "selection": {}, "index": {}, "phi": {}}
    for section in args.sections.split(","):
        {"selection": probe_selection, "index": probe_index, "phi": probe_phi}[section](out)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
