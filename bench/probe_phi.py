"""Probe (timing only): nsa::phi_mlp for NSA's key and value sets (one op, forward + backward) at the training
shapes, by its tile sizes, as CUDA graph replays.

    python bench/probe_phi.py [--shapes 16:2048,4:8192,1:32768] --out DIR --commit SHA [--suffix=-v47f]

Rows per program of the forward and the row backward (LaunchConfig.phi_rows; v29 kept 32 over 64), of the
W1-gradient and x-gradient kernels (triton_impl._PHI_W1_ROWS, _PHI_DX_ROWS, 64 each), and the x-gradient kernel's
offsets u per program (_PHI_DX_OFFSETS; 1 is one a program, as before v49). nsa-125m's phi: l = 32, d = 16, head
dim 64, hidden 128, two kv groups. Writes DIR/probe-<device>-<date><suffix>.json and .md (microseconds a layer
call, k and v together).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit  # noqa: E402
from bench.shapes import batch_shapes  # noqa: E402

# (label, phi_rows, _PHI_W1_ROWS, _PHI_DX_ROWS, _PHI_DX_OFFSETS); the first is the default
VARIANTS = [("default (32, 64, 64, 16)", 32, 64, 64, 16), ("dx offsets 1", 32, 64, 64, 1),
            ("dx offsets 4", 32, 64, 64, 4), ("dx offsets 8", 32, 64, 64, 8), ("dx rows 32", 32, 64, 32, 16),
            ("rows 64", 64, 64, 64, 16)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=batch_shapes, default="16:2048,4:8192,1:32768")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    import torch
    import triton.testing

    from bench.kernel_variants import write_times
    from nsa_model.ops import triton_impl as ti

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_phi.py needs a CUDA GPU")
    G, D, hidden, block, stride = 2, 64, 128, 32, 16
    gen = torch.Generator("cuda").manual_seed(0)

    def weights():
        return (torch.randn(hidden, block * D, device="cuda", generator=gen) * 0.02,
                torch.zeros(hidden, device="cuda"), torch.randn(D, hidden, device="cuda", generator=gen) * 0.05,
                torch.zeros(D, device="cuda"))

    wk, wv = weights(), weights()
    for w in (*wk, *wv):
        w.requires_grad_(True)
    results = {label: {} for label, *_ in VARIANTS}
    base = ti.launch_config()
    for B, T in args.shapes:
        xk, xv = (torch.randn(B, T, G, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_(True)
                  for _ in range(2))
        dy = torch.randn(B, (T - block) // stride + 1, G, D, device="cuda", generator=gen, dtype=torch.bfloat16)

        def step():
            yk, yv = ti.phi_mlp_pair(xk, xv, wk, wv, block, stride)
            torch.autograd.backward([yk, yv], [dy, dy])

        for label, rows, w1_rows, dx_rows, dx_offsets in VARIANTS:
            ti._PHI_W1_ROWS, ti._PHI_DX_ROWS, ti._PHI_DX_OFFSETS = w1_rows, dx_rows, dx_offsets
            with ti.use_launch_config(dataclasses.replace(base, phi_rows=rows)):
                ms = triton.testing.do_bench_cudagraph(step, return_mode="median",
                                                       grad_to_none=[xk, xv, *wk, *wv])
            results[label][f"{B} x {T}"] = 1000 * ms
            print(f"{B} x {T}: {label} {1000 * ms:.1f} us", flush=True)
        ti._PHI_W1_ROWS, ti._PHI_DX_ROWS, ti._PHI_DX_OFFSETS = VARIANTS[0][2:]
    stem = write_times(args.out, args.suffix, args.commit or git_commit(), results,
                       title="phi's k and v sets, forward + backward, by tile sizes", unit="us", fmt=".1f",
                       note="CUDA graph replays (do_bench_cudagraph, median), microseconds a layer call; nsa-125m's "
                            "phi (l 32, d 16, head dim 64, hidden 128, 2 groups), bf16 inputs, float32 weights.",
                       column=lambda key: key)
    print(stem)


if __name__ == "__main__":
    main()
