"""CPU forward+backward time and peak memory of the tiny NSA model vs the tiny dense model, in one run.

    python bench/cpu_model.py                       # T = 1024 and 4096, writes bench/results/cpu-model-<date>.*
    python bench/cpu_model.py --seq-lens 256 --repeats 2

Each (model, T) is measured in a fresh subprocess, so that its peak memory is its own: peak memory is the
process's peak resident set size (getrusage ru_maxrss, the kernel's high-water mark) minus the RSS just
before the first step, i.e. what one forward+backward adds on top of the model, its gradients' absence and
its inputs. tracemalloc is not used: it sees only Python's allocator, not torch's tensor memory.
Time is the median of --repeats timed steps after one warm-up step. The NSA model runs the vectorized torch
backend (the CPU path of backend="auto").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_one(attention: str, seq_len: int, batch: int, repeats: int) -> dict:
    """Runs in the child process: build the model, time fwd+bwd, report peak RSS growth."""
    import torch

    from nsa_model import Transformer, get_preset

    cfg = get_preset("tiny").replace(attention=attention, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        return time.perf_counter() - start

    rss_before = _rss_bytes()
    step()  # warm-up (also the first peak)
    times = [step() for _ in range(repeats)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is in KiB on Linux
    return {"attention": attention, "seq_len": seq_len, "batch": batch, "params": model.num_params(),
            "fwd_bwd_s": statistics.median(times), "fwd_bwd_s_all": times,
            "peak_step_mem_mb": (peak - rss_before) / 2**20, "threads": torch.get_num_threads(),
            "flops_per_token": model.flops_per_token(seq_len)}


def _child(attention: str, seq_len: int, batch: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", attention, str(seq_len), str(batch), str(repeats)]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {attention} at T={seq_len} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "nsa_model", "bench"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "uncommitted"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        attention, seq_len, batch, repeats = args.child
        print(json.dumps(measure_one(attention, int(seq_len), int(batch), int(repeats))))
        return
    if args.batch < 1 or args.repeats < 1 or any(t < 1 for t in args.seq_lens):
        parser.error("--batch, --repeats and --seq-lens must be positive")

    import torch

    rows = []
    for seq_len in args.seq_lens:
        dense = _child("dense", seq_len, args.batch, args.repeats)
        nsa = _child("nsa", seq_len, args.batch, args.repeats)
        rows.append({"seq_len": seq_len, "dense": dense, "nsa": nsa,
                     "time_ratio_nsa_to_dense": nsa["fwd_bwd_s"] / dense["fwd_bwd_s"],
                     "mem_ratio_nsa_to_dense": nsa["peak_step_mem_mb"] / max(dense["peak_step_mem_mb"], 1e-9)})

    now = dt.datetime.now(dt.timezone.utc)
    result = {"date": now.isoformat(timespec="seconds"), "commit": _git_commit(), "torch": torch.__version__,
              "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
              "model": "tiny preset (max_seq_len raised to T)", "batch": args.batch, "repeats": args.repeats,
              "memory_method": "peak RSS (ru_maxrss) minus RSS before the first step, fresh process per row",
              "rows": rows}
    header = "| T | dense fwd+bwd (s) | NSA fwd+bwd (s) | NSA/dense time | dense peak (MB) | NSA peak (MB) | NSA/dense mem |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for r in rows:
        d, n = r["dense"], r["nsa"]
        lines.append(f"| {r['seq_len']} | {d['fwd_bwd_s']:.3f} | {n['fwd_bwd_s']:.3f} | {r['time_ratio_nsa_to_dense']:.2f}x"
                     f" | {d['peak_step_mem_mb']:.0f} | {n['peak_step_mem_mb']:.0f} | {r['mem_ratio_nsa_to_dense']:.2f}x |")
    table = "\n".join(lines)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"cpu-model-{now.strftime('%Y-%m-%d')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# CPU model benchmark: tiny NSA vs tiny dense, forward+backward\n\n"
          f"date {result['date']}, commit {result['commit']}, torch {result['torch']}, CPU {result['cpu']} "
          f"({result['cpu_count']} cores, 1-min load {result['load_avg_1m']:.1f}), batch {args.batch}, "
          f"median of {args.repeats}.\nMemory: {result['memory_method']}.\n\n{table}\n")
    stem.with_suffix(".md").write_text(md)
    print(table)
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
