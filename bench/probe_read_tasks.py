"""How many Ray worker processes a stream of prepared blocks starts, and how soon its first batch comes, with the
read stage capped at data.read_tasks tasks against left to Ray Data (the code before stop 83).

Each arm runs in a fresh process with a fresh Ray cluster of --cpus logical CPUs, --held-cpus of them held by an
actor as a training worker and a trial's driver hold theirs. The stream is iterated on a thread, as a training
worker's StreamStart does, to its first micro-batch; the probe then waits --settle seconds and counts the Ray worker
processes alive, then reads the rest of the split and times the pass.

    python bench/probe_read_tasks.py --out bench/results/probe-read-tasks-<device>-<date>.md

The prepared data is the sweep's (configs/sweep-125m-gpu.yaml: the installed-packages corpus, byte tokens, T = 8192),
made once under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def data_config(work: Path, read_tasks: int):
    from pipeline.data.config import DataConfig
    return DataConfig(source="embedded", embedded_scope="installed", tokenizer="bytes", seq_len=8192,
                      val_fraction=0.02, output_dir=str(work / "out"), packed_dir=str(work / "packed"),
                      read_tasks=read_tasks)


def ray_worker_processes() -> int:
    import psutil
    count = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        count += cmd.startswith("ray::") or "default_worker.py" in cmd  # a worker names itself ray::<task>
    return count


def arm(args) -> dict:
    """One arm, in this process: the numbers as a dict."""
    import ray
    import ray.data

    from pipeline.data import prepared
    from pipeline.data.shards import prepared_shares

    uncapped = args.arm == "uncapped"
    cfg = data_config(Path(args.work), read_tasks=1 if uncapped else args.read_tasks)
    if uncapped:  # the read stage as it was: no compute strategy given, Ray Data sizes it by the CPUs free
        ray.data.TaskPoolStrategy = lambda size: None
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=args.held_cpus)
    class Held:
        def ready(self) -> bool:
            return True

    held = Held.remote()
    ray.get(held.ready.remote())
    before = ray_worker_processes()
    pieces = prepared_shares(cfg, "train", 1).ranks[0]
    ds = prepared.read_prepared_blocks(cfg, pieces)
    got: dict = {}

    def first_batch():
        start = time.perf_counter()
        batches = iter(ds.iter_batches(batch_size=4, batch_format="numpy"))
        got["blocks"] = len(next(batches)["index"])
        got["first_s"] = time.perf_counter() - start
        got["batches"] = batches

    thread = threading.Thread(target=first_batch, daemon=True)
    thread.start()
    thread.join()
    time.sleep(args.settle)
    started = ray_worker_processes() - before
    start = time.perf_counter()
    for batch in got["batches"]:
        got["blocks"] += len(batch["index"])
    rest_s = time.perf_counter() - start
    return {"arm": args.arm, "row_groups": len(pieces), "first_batch_s": round(got["first_s"], 2),
            "worker_processes_started": started, "blocks": got["blocks"],
            "whole_pass_s": round(got["first_s"] + args.settle + rest_s, 1), "rest_s": round(rest_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", choices=["uncapped", "capped"], help="run one arm in this process (internal)")
    ap.add_argument("--cpus", type=int, default=16, help="logical CPUs of the probe's Ray cluster (the GPU host's)")
    ap.add_argument("--held-cpus", type=float, default=5.0, help="CPUs held as a trial's worker and driver hold")
    ap.add_argument("--read-tasks", type=int, default=2, help="data.read_tasks of the capped arm")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after the first batch before counting")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default="/tmp/probe-read-tasks")
    ap.add_argument("--out", help="markdown file to write")
    args = ap.parse_args()
    if args.arm:
        print("RESULT " + json.dumps(arm(args)), flush=True)
        os._exit(0)  # Ray's shutdown at exit can outlive the numbers; they are printed
    work = Path(args.work)
    if not (work / "packed" / "manifest.json").exists():
        import ray

        from pipeline.data.prepared import prepare_blocks
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        prepare_blocks(data_config(work, 1).replace(packed_dir=None), work / "packed")
        ray.shutdown()
    rows = []
    for _ in range(args.repeats):
        for name in ("uncapped", "capped"):
            cmd = [sys.executable, __file__, "--arm", name, "--cpus", str(args.cpus), "--held-cpus",
                   str(args.held_cpus), "--read-tasks", str(args.read_tasks), "--settle", str(args.settle),
                   "--work", str(work)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"arm {name} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            rows.append(json.loads(lines[-1][len("RESULT "):]))
            print(rows[-1], flush=True)
    if args.out:
        import platform

        import ray

        from provenance import git_commit
        where = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()}, "
                 f"{platform.node() or 'this host'}: {os.cpu_count()} cores, Python {platform.python_version()}, "
                 f"ray {ray.__version__}")
        head = ("| arm | row groups | first micro-batch s | worker processes started | blocks | "
                "whole pass s (with the settle) |\n|---|---|---|---|---|---|\n")
        body = "".join(f"| {r['arm']}{'' if r['arm'] == 'uncapped' else f' at {args.read_tasks}'} | "
                       f"{r['row_groups']} | {r['first_batch_s']} | {r['worker_processes_started']} | {r['blocks']} | "
                       f"{r['whole_pass_s']} |\n" for r in rows)
        Path(args.out).write_text(
            f"# A stream of prepared blocks: its read stage capped (data.read_tasks) against left to Ray Data\n\n"
            f"{where}\n\n`python bench/probe_read_tasks.py --cpus {args.cpus} --held-cpus "
            f"{args.held_cpus} --read-tasks {args.read_tasks} --settle {args.settle} --repeats {args.repeats}`; "
            f"each arm a fresh process and Ray cluster ({args.cpus} logical CPUs, {args.held_cpus} held).\n\n"
            + head + body)


if __name__ == "__main__":
    main()
