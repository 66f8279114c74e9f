"""Timing only (no checks): nsa::rope_split forward and backward at the training shapes, for several token counts
per program (triton_impl._ROPE_TOKENS), against a plain copy of the same bytes in the same run.

    python bench/probe_rope.py --tokens 8,4,2 [--seq-len 8192 --micro-tokens 32768] --out DIR --commit SHA

The op moves each byte of the fused projection once each way, so its floor is a copy: `y.clone()` of the
projection output, timed beside it. Rows: nsa-125m's parts (q, three rotated key sets, three value sets, the gate
columns: 1600 columns) and dense-125m's (q, k, v: 1024). kernels-notes.md v37: at 8 tokens a program the kernel
takes 231 / 242 registers (two programs a multiprocessor) and ran NSA's parts at about 2.4 TB/s in the T = 8192
step. Writes DIR/probe-rope-<device>-<date><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit, result_stem  # noqa: E402

# (label, heads, head dims, rotated) of the fused projection's parts, as nsa_model/attention.py builds them
PARTS = {
    "nsa-125m": ([12, 2, 2, 2, 2, 2, 2, 1], [64] * 8, [True] * 4 + [False] * 4),
    "dense-125m": ([12, 2, 2], [64] * 3, [True, True, False]),
}


def parse_tokens(text: str) -> list[int]:
    """--tokens: comma-separated powers of two, each at least 1."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 8,4,2") from None
    if not values or any(v < 1 or v & (v - 1) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every token count must be a power of two >= 1")
    return values


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=parse_tokens, default=[8, 4, 2])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro-tokens", type=int, default=32768)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch
    import triton.testing

    from nsa_model.ops import triton_impl as ti
    from nsa_model.rope import RotaryEmbedding

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_rope.py needs a CUDA GPU")
    if args.micro_tokens % args.seq_len:
        raise SystemExit(f"--micro-tokens {args.micro_tokens} must be a multiple of --seq-len {args.seq_len}")
    B, T = args.micro_tokens // args.seq_len, args.seq_len
    rope = RotaryEmbedding(64, T, 10000.0).cuda()
    os.makedirs(args.out, exist_ok=True)
    stem, meta = result_stem(args.out, "probe-rope", args.suffix, args.commit or git_commit())
    stem = str(stem)
    rows = []
    for label, (heads, dims, rotate) in PARTS.items():
        width = sum(h * d for h, d in zip(heads, dims))
        y = torch.randn(B, T, width, device="cuda", dtype=torch.bfloat16)
        grads = [torch.randn(B, T, h, d, device="cuda", dtype=torch.bfloat16) for h, d in zip(heads, dims)]
        copy_ms = triton.testing.do_bench(lambda: y.clone())
        moved = 2 * y.numel() * y.element_size()  # read once, written once
        for tokens in args.tokens:
            ti._ROPE_TOKENS = tokens
            fwd = triton.testing.do_bench(lambda: ti._rope_split(y, rope.cos, rope.sin, heads, dims, rotate))
            bwd = triton.testing.do_bench(lambda: ti._rope_split_bwd(grads, rope.cos, rope.sin, heads, dims, rotate))
            rows.append({"parts": label, "width": width, "tokens": tokens, "fwd_ms": fwd, "bwd_ms": bwd,
                         "copy_ms": copy_ms, "fwd_tb_s": moved / fwd / 1e9, "bwd_tb_s": moved / bwd / 1e9,
                         "copy_tb_s": moved / copy_ms / 1e9})
            print(json.dumps(rows[-1]), flush=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# nsa::rope_split by tokens per program: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}; B x T = {B} x {T}, bf16, "
             "median of do_bench; a copy of the same bytes (`y.clone()`) in the same run", "",
             "| parts | columns | tokens a program | forward ms (TB/s) | backward ms (TB/s) | copy ms (TB/s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['parts']} | {r['width']} | {r['tokens']} | {r['fwd_ms']:.4f} ({r['fwd_tb_s']:.2f}) | "
                     f"{r['bwd_ms']:.4f} ({r['bwd_tb_s']:.2f}) | {r['copy_ms']:.4f} ({r['copy_tb_s']:.2f}) |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
