"""Timing only: does copying a host batch to the GPU hold the host until the GPU has run its queued work?

    python bench/probe_host_copy.py [--queued-ms 200] --out DIR --commit SHA

The training loop copies each micro-batch of tokens (int64 [micro_batch, T + 1], from the loader's pageable memory)
to the GPU while the previous micro-batch's backward is still queued. If that copy waits for the stream, the host
launches the next forward only when the GPU has drained, and the GPU idles for the launch. Here the stream is
given a sleep kernel of about --queued-ms first, then the host copies a batch, either from pageable memory as the
loop does (`tensor.to(device, non_blocking=True)`) or page-locked first (`tensor.pin_memory().to(...)`), and the
probe reports how long the copy call held the host and whether the GPU was still busy when it returned.
Measured on an H100 (kernels-notes.md v46): neither waits for the stream; the page-locked way holds the host
longer (0.2 against 0.1 ms), so the loop copies from pageable memory.
Shapes: the micro-batches of the T = 2048 (16 x 2049), 8192 (4 x 8193) and 32768 (1 x 32769) benchmarks.
Writes DIR/probe-host-copy-<device>-<date><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402

SHAPES = ((16, 2049), (4, 8193), (1, 32769))
WAYS = ("pageable", "pinned")


def sleep_cycles(queued_ms: float) -> int:
    """Clock cycles of torch.cuda._sleep that take about queued_ms on this GPU, measured."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * queued_ms / start.elapsed_time(end))


def copy_once(way: str, batch, device, cycles: int) -> tuple[float, bool]:
    """(ms the copy call held the host, whether the GPU was still on the queued work when it returned)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    source = batch if way == "pageable" else batch.pin_memory()
    out = source.to(device, non_blocking=True)
    held_ms = (time.perf_counter() - t0) * 1e3
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    if not torch.equal(out.cpu(), batch):
        raise SystemExit(f"{way}: the copy's values differ")
    return held_ms, busy


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queued-ms", type=float, default=200.0, help="GPU work queued before each copy (ms)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--commit", default=None)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--suffix", type=file_suffix, default="")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/probe_host_copy.py needs a CUDA GPU")
    device = torch.device("cuda")
    cycles = sleep_cycles(args.queued_ms)
    rows = []
    for shape in SHAPES:
        batch = torch.randint(0, 50304, shape)
        for way in WAYS:
            copy_once(way, batch, device, cycles // 100)  # warm: the host allocator's page-locked blocks
            runs = [copy_once(way, batch, device, cycles) for _ in range(args.repeats)]
            rows.append({"shape": list(shape), "kib": batch.numel() * 8 / 1024, "way": way,
                         "held_ms": statistics.median(r[0] for r in runs), "held_ms_all": [r[0] for r in runs],
                         "gpu_busy_at_return": sum(r[1] for r in runs), "repeats": len(runs)})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem, meta = result_stem(args.out, "probe-host-copy", args.suffix, args.commit or git_commit())
    meta["queued_ms"] = args.queued_ms
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Host batch to GPU behind {args.queued_ms:.0f} ms of queued work: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}; median of {args.repeats} copies each", "",
             "| batch (int64) | KiB | copy | host held (ms, median) | GPU still busy at return |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape'][0]} x {r['shape'][1]} | {r['kib']:.0f} | {r['way']} | {r['held_ms']:.3f} | "
                     f"{r['gpu_busy_at_return']} of {r['repeats']} |")
    result_file(stem, ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
