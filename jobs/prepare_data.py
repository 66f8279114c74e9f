"""Prepare training data once: read, clean, tokenize and pack both splits into Parquet shards + a manifest.

    python jobs/prepare_data.py [--config configs/tiny.yaml] [--set data.source=...] [--out DIR]
    python jobs/prepare_data.py --train-tokenizer OUT.json [--set data.vocab_size=32768 ...]
    python jobs/prepare_data.py --set data.embedded_scope=installed   # the larger embedded corpus

Uses the `data` section of the job config (pipeline.config.load_job_config). Writes to --out, else
data.packed_dir when set, else outputs/packed/<source>-<tokenizer>-L<seq_len>-...; then train with
--set data.packed_dir=<that folder>. With --train-tokenizer, instead trains a byte-level BPE of
data.vocab_size on the first data.tokenizer_train_docs documents of data.source and saves it. Joins the Ray cluster of RAY_ADDRESS / `ray job submit`, else starts
a local one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import ray  # noqa: E402

from pipeline.config import load_job_config  # noqa: E402
from pipeline.data import default_packed_dir, load_tokenizer, prepare_blocks  # noqa: E402
from pipeline.data.tokenizer import train_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    """Returns the folder written (or the tokenizer file)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="job YAML (default configs/tiny.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. data.seq_len=512 (repeatable)")
    parser.add_argument("--out", default=None, help="output folder (default: data.packed_dir or outputs/packed/...)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--train-tokenizer", default=None, metavar="OUT.json",
                        help="train a BPE on data.source and save it here (no packing)")
    args = parser.parse_args(argv)

    cfg = load_job_config(args.config, args.overrides).data  # validated before anything starts
    print("data config:", json.dumps(cfg.to_dict(), indent=2))
    if args.train_tokenizer:
        path = train_tokenizer(cfg, Path(args.train_tokenizer).resolve())
        tok = load_tokenizer(cfg.replace(tokenizer=str(path)))
        print(f"trained {tok.vocab_size}-token BPE (eos id {tok.eos_id}, sha256 {tok.sha256[:12]}): {path}")
        print(f"use it with: --set data.tokenizer={path}")
        return path
    ray.init(ignore_reinit_error=True)  # RAY_ADDRESS / ray job submit -> that cluster; else a local one
    out = Path(args.out or cfg.packed_dir or default_packed_dir(cfg)).resolve()
    start = time.time()
    manifest = prepare_blocks(cfg, out, progress=not args.no_progress)
    seconds = time.time() - start
    for split, info in manifest["splits"].items():
        s = info["stats"]
        print(f"{split}: {info['blocks']} blocks ({info['tokens']} tokens) in {len(info['shards'])} shard(s); "
              f"documents read {s['documents_read']}, kept {s['documents_kept']}, dropped {s['dropped']}, "
              f"altered {s['altered']}, final partial block {s['partial_block_tokens']} tokens")
    print(f"prepared in {seconds:.1f} s: {out}")
    print(f"train on it with: --set data.packed_dir={out}")
    return out


if __name__ == "__main__":
    main()
