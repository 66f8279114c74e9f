"""Throughput of the Ray Data pipeline against plain `tokenizers` encode_batch, same text, same cores, one run.

    python bench/data.py [--scope installed] [--max-files N] [--repeats 3]

Text: the embedded corpus of --scope (default "installed": every installed package's docs, tens of millions
of characters, so the steady state dominates), read from its FineWeb-Edu-schema Parquet files.
Baseline: the embedded BPE's Rust `Tokenizer.encode_batch` over the same documents, already in memory, in
batches of data.read_batch_rows documents (the documented batched call; one call over the whole list was
4-5x slower here, so the batched one is the stronger baseline). Pipeline: block_dataset(...) from the Parquet files (read,
clean, tokenize, pack), consumed to the end; Ray is started before timing, everything the dataset does
(its worker and actor start-up included) counts. Tokens/s count document tokens + EOS; both sides must
count the same tokens. Repeats alternate baseline and pipeline so that the machine's load hits both; the
best of each is compared. Target: pipeline / baseline >= 0.8.
Writes bench/results/data-<date>.json and .md (date, commit, cores, load averages).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402

from pipeline.data import DataConfig, StatsRecorder, block_dataset, load_tokenizer, resolved_config  # noqa: E402
from pipeline.data.source import list_source_files  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def bench_config(scope: str, max_files: int | None, output_dir: str) -> DataConfig:
    # No validation split and no long-document splitting: the pipeline tokenizes exactly the documents
    # the baseline does (cleaning still runs and is timed).
    return resolved_config(DataConfig(embedded_scope=scope, max_files=max_files, output_dir=output_dir,
                                      val_fraction=0.0, max_doc_chars=1 << 40))


def load_texts(cfg: DataConfig) -> list[str]:
    _, files = list_source_files(cfg)
    return [t for f in files for t in pq.read_table(f, columns=[cfg.text_column]).column(0).to_pylist()]


def time_plain(raw_tokenizer, texts: list[str], batch: int | None) -> dict:
    """encode_batch over `batch`-document slices (None: one call over the whole list)."""
    start = time.perf_counter()
    step = batch or len(texts)
    tokens = len(texts)  # one EOS per document, as the pipeline counts
    for i in range(0, len(texts), step):
        tokens += sum(len(e.ids) for e in raw_tokenizer.encode_batch(texts[i:i + step], add_special_tokens=False))
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def time_pipeline(cfg: DataConfig) -> dict:
    recorder = StatsRecorder()
    start = time.perf_counter()
    blocks, first = 0, None
    for batch in block_dataset(cfg, "train", stats=recorder).iter_batches(batch_size=1024, batch_format="numpy"):
        first = first or time.perf_counter() - start
        blocks += len(batch["index"])
    seconds = time.perf_counter() - start
    stats = recorder.snapshot()
    if stats.blocks != blocks:
        raise RuntimeError(f"the stream delivered {blocks} blocks but the packer made {stats.blocks}")
    tokens = stats.stream_tokens
    return {"tokens": tokens, "blocks": blocks, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "first_batch_s": first}


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "pipeline/data", "bench/data.py"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+uncommitted" if dirty else "")
    except subprocess.CalledProcessError:
        return "uncommitted"


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scope", default="installed", choices=("stdlib", "installed"))
    parser.add_argument("--max-files", type=int, default=None, help="only the first N corpus files")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", default="outputs", help="where the embedded corpus and tokenizer live")
    parser.add_argument("--no-write", action="store_true", help="print only (exploratory runs)")
    args = parser.parse_args()
    cfg = bench_config(args.scope, args.max_files, args.output_dir)  # builds corpus and tokenizer if missing
    tokenizer = load_tokenizer(cfg)
    texts = load_texts(cfg)
    load_before = load()
    ray_start = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - ray_start
    ray.data.DataContext.get_current().enable_progress_bars = False
    runs = []
    for _ in range(args.repeats):  # alternate, so that load changes hit both sides
        plain = time_plain(tokenizer._tok, texts, cfg.read_batch_rows)
        pipeline = time_pipeline(cfg)
        runs.append({"plain": plain, "pipeline": pipeline, "load": load()})
        print(json.dumps(runs[-1]), flush=True)
    ray.shutdown()
    plain = max((r["plain"] for r in runs), key=lambda r: r["tokens_per_s"])
    pipeline = max((r["pipeline"] for r in runs), key=lambda r: r["tokens_per_s"])
    if pipeline["tokens"] != plain["tokens"]:
        raise RuntimeError(f"token counts differ: pipeline {pipeline['tokens']}, baseline {plain['tokens']}")
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(), "cores": os.cpu_count(),
        "device": "CPU only", "load_average_before": load_before, "load_average_after": load(),
        "note": "2 shared cores; other engineers' jobs ran at the same time (see load averages)",
        "scope": args.scope, "files": len(list_source_files(cfg)[1]), "documents": len(texts),
        "chars": sum(map(len, texts)), "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
        "seq_len": cfg.seq_len, "read_batch_rows": cfg.read_batch_rows, "ray_init_s": round(ray_start, 2),
        "plain_encode_batch": plain, "ray_data_pipeline": pipeline,
        "runs": runs, "ratio": pipeline["tokens_per_s"] / plain["tokens_per_s"], "target_ratio": 0.8,
    }
    print(json.dumps(result, indent=2))
    if not args.no_write:
        write_results(result)


def write_results(r: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    date = r["date"][:10]
    (RESULTS / f"data-{date}.json").write_text(json.dumps(r, indent=2))
    plain, pipe = r["plain_encode_batch"], r["ray_data_pipeline"]
    rows = "\n".join(f"| {i} | {x['plain']['tokens_per_s']:,.0f} | {x['pipeline']['tokens_per_s']:,.0f} | "
                     f"{x['pipeline']['first_batch_s']:.1f} | {x['load']} |" for i, x in enumerate(r["runs"]))
    (RESULTS / f"data-{date}.md").write_text(
        f"# Data pipeline throughput ({r['date']})\n\n"
        f"commit {r['commit']}, {r['device']}, {r['cores']} cores, load average before {r['load_average_before']}, "
        f"after {r['load_average_after']} ({r['note']}).\n\n"
        f"Embedded corpus `{r['scope']}`: {r['files']} files, {r['documents']} documents, {r['chars']:,} chars; "
        f"tokenizer {r['tokenizer']} (vocab {r['vocab_size']}), seq_len {r['seq_len']}, "
        f"read_batch_rows {r['read_batch_rows']}. ray.init took {r['ray_init_s']} s (not counted).\n\n"
        "| path (best of the runs) | tokens | seconds | tokens/s |\n|---|---|---|---|\n"
        f"| plain tokenizers encode_batch, {r['read_batch_rows']} documents per call (baseline) | {plain['tokens']} | "
        f"{plain['seconds']:.2f} | {plain['tokens_per_s']:,.0f} |\n"
        f"| Ray Data pipeline (read, clean, tokenize, pack) | {pipe['tokens']} | {pipe['seconds']:.2f} | "
        f"{pipe['tokens_per_s']:,.0f} |\n\n"
        f"**ratio {r['ratio']:.2f}** (pipeline / baseline, target >= 0.8); the pipeline's first batch arrived "
        f"after {pipe['first_batch_s']:.1f} s (its worker and actor start-up included).\n\n"
        "Runs, alternating (tokens/s):\n\n| run | baseline | pipeline | first batch s | load after |\n"
        f"|---|---|---|---|---|\n{rows}\n")


if __name__ == "__main__":
    main()
