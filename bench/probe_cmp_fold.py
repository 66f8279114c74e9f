"""Probe (timing and agreement): the compressed branch as causal attention over folded queries, by cuDNN, against
our range kernels.

    python bench/probe_cmp_fold.py [--shapes 125m:16:2048,...] --out DIR --commit SHA [--suffix=-v48a]

Query t sees the compressed tokens 0 .. floor((t + 1 - l) / d) (NSA_SPEC.md section 1). So the d queries
t = l - 1 + d m .. l - 1 + d m + d - 1 all see tokens 0 .. m: fold them into one row m of d x H heads (head
r H + h is query l - 1 + d m + r, head h) and the branch is plain causal attention of Tc rows over Tc tokens,
with each token's K/V repeated for the d row positions (head r G + g serves heads r H + g H/G ..). Queries before
l - 1 see nothing (output 0). The fold of q is a pad of at most d - 1 rows and a view; the fold of o a view and a
slice.

Per shape, fwd + bwd as CUDA graph replays (ms): ours (`compressed_attention`, the range kernels), cuDNN on the
folded tensors with the folds and their backward, cuDNN on pre-folded tensors alone (the folds' lower bound), and
dense cuDNN over all T for scale. Before timing: our output and gradients against the folded cuDNN's (bf16 both).
Writes DIR/probe-<device>-<date><suffix>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit  # noqa: E402
from bench.shapes import FAMILIES, ISSUE4_SHAPES, family_shapes  # noqa: E402


def fold_queries(x, l: int, d: int, Tc: int):
    """[B, T, H, D] -> [B, d H, Tc, D] (a strided view after one pad): row m, head r H + h is x[l - 1 + d m + r, h]."""
    import torch.nn.functional as F
    B, T, H, D = x.shape
    rows = x[:, l - 1:]
    rows = F.pad(rows, (0, 0, 0, 0, 0, d * Tc - rows.shape[1]))
    return rows.view(B, Tc, d * H, D).transpose(1, 2)


def repeat_tokens(k, d: int):
    """[B, Tc, G, D] -> [B, d G, Tc, D]: head r G + g is k[:, :, g] (materialized: d x the compressed set)."""
    B, Tc, G, D = k.shape
    return k[:, :, None].expand(B, Tc, d, G, D).reshape(B, Tc, d * G, D).transpose(1, 2)


def unfold_output(o_f, l: int, d: int, T: int):
    """[B, d H, Tc, D] -> [B, T, H, D], zeros before query l - 1."""
    import torch.nn.functional as F
    B, dH, Tc, D = o_f.shape
    rows = o_f.transpose(1, 2).reshape(B, Tc * d, dH // d, D)[:, :T - l + 1]
    return F.pad(rows, (0, 0, 0, 0, l - 1, 0))


def folded_cmp(q, k, v, l: int, d: int, scale: float):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    T, Tc = q.shape[1], k.shape[1]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_f = F.scaled_dot_product_attention(fold_queries(q, l, d, Tc), repeat_tokens(k, d), repeat_tokens(v, d),
                                             is_causal=True, scale=scale, enable_gqa=True)
    return unfold_output(o_f, l, d, T)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=family_shapes, default=ISSUE4_SHAPES)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--skip", default="", help="comma-separated timings not to run (their labels)")
    args = ap.parse_args()
    args.skip = [x for x in args.skip.split(",") if x]
    import torch
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.kernel_variants import write_times
    from nsa_model.config import NSAConfig
    from nsa_model.ops import triton_impl as ti

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_cmp_fold.py needs a CUDA GPU")
    cfg = NSAConfig()
    l, d = cfg.cmp_block, cfg.cmp_stride
    short = [s for s in args.shapes if s[2] < l]
    if short:
        raise SystemExit(f"--shapes: {short} have T < l = {l}: no compressed token to attend to")
    gen = torch.Generator("cuda").manual_seed(0)
    results = {k: {} for k in ("ours (range kernels)", "cuDNN folded, with folds", "cuDNN folded, alone",
                               "dense cuDNN", "max rel err o", "max rel err dq", "max rel err dk", "max rel err dv")}
    for family, B, T in args.shapes:
        H, G, D = (FAMILIES[family][x] for x in "HGD")
        Tc = (T - l) // d + 1
        scale = D ** -0.5
        key = f"{family} {B} x {T}"

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

        q, do = rand(B, T, H, D), rand(B, T, H, D)
        k, v = rand(B, Tc, G, D), rand(B, Tc, G, D)
        for x in (q, k, v):
            x.requires_grad_(True)

        def ours(q, k, v):
            o, _ = ti.compressed_attention(q, k, v, cfg, scale)
            return o

        def folded(q, k, v):
            return folded_cmp(q, k, v, l, d, scale)

        grads = {}
        for name, fn in (("ours", ours), ("folded", folded)):
            # leaves of their own: a leaf whose backward first ran outside the capture on the default stream
            # makes the capture's backward wait on that stream, which CUDA refuses
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            o = fn(*leaves)
            o.backward(do)
            grads[name] = [o.detach().float()] + [x.grad.float() for x in leaves]
        for i, what in enumerate(("o", "dq", "dk", "dv")):
            a, b = grads["ours"][i], grads["folded"][i]
            err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
            results[f"max rel err {what}"][key] = err
        print(key, {w: results[f"max rel err {w}"][key] for w in ("o", "dq", "dk", "dv")}, flush=True)

        q_f = fold_queries(q.detach(), l, d, Tc).contiguous().requires_grad_(True)  # BHSD, pre-folded
        k_f, v_f = (repeat_tokens(x.detach(), d).contiguous().requires_grad_(True) for x in (k, v))
        do_f = fold_queries(do, l, d, Tc).contiguous()
        qd = q.detach().transpose(1, 2).contiguous().requires_grad_(True)
        kd, vd = (rand(B, T, G, D).transpose(1, 2).contiguous().requires_grad_(True) for _ in range(2))
        dod = do.transpose(1, 2).contiguous()

        def step(fn, *args, grad):
            def run():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = fn(*args)
                out.backward(grad)
            return run

        def alone(qq, kk, vv):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)

        runs = {"ours (range kernels)": (step(ours, q, k, v, grad=do), [q, k, v]),
                "cuDNN folded, with folds": (step(folded, q, k, v, grad=do), [q, k, v]),
                "cuDNN folded, alone": (step(alone, q_f, k_f, v_f, grad=do_f), [q_f, k_f, v_f]),
                "dense cuDNN": (step(alone, qd, kd, vd, grad=dod), [qd, kd, vd])}
        for label, (fn, leaves) in runs.items():
            if label in args.skip:
                results[label][key] = float("nan")
                continue
            print(f"{key}: {label} ...", flush=True)
            try:
                fn()  # once outside the capture first (cuDNN builds its plans)
                torch.cuda.synchronize()
                ms = triton.testing.do_bench_cudagraph(fn, return_mode="median", grad_to_none=leaves)
            except Exception as err:  # reported in the table as nan, and why printed
                print(f"{key}: {label} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
                ms = float("nan")
            results[label][key] = ms
            print(f"{key}: {label} {ms:.3f} ms", flush=True)
    stem = write_times(args.out, args.suffix, args.commit or git_commit(), results,
                       title="the compressed branch over folded queries by cuDNN, against the range kernels",
                       unit="ms (errors: max |ours - cuDNN| / max |cuDNN|)", fmt=".4g",
                       note="fwd + bwd, CUDA graph replays (do_bench_cudagraph, median), bf16; l 32, d 16. "
                            "'alone' times cuDNN on pre-folded contiguous tensors (no fold, pad or slice).")
    print(stem)


if __name__ == "__main__":
    main()
