"""Shared helpers for the train/job tests (no tests here): a very small model and prepared data.

The prepared blocks (one corpus file, seq_len 32) are built once with the data stage's own prepare step and
cached under outputs/test-cache/, so each Ray run in the tests reads packed Parquet instead of re-tokenizing.
"""

from __future__ import annotations

import json
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / "outputs" / "test-cache"
SEQ_LEN = 32

# A ~100k-parameter NSA model: 1 layer, 2 heads over 1 KV head, blocks small enough that selection is sparse.
SMALL_MODEL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
               f"model.max_seq_len={SEQ_LEN}", "model.nsa.cmp_block=8", "model.nsa.cmp_stride=4",
               "model.nsa.sel_block=8", "model.nsa.n_selected=3", "model.nsa.window=8"]


ROW_GROUP_BLOCKS = 64  # row groups (the unit dealt to workers) much smaller than the splits, as at scale


def prepared_data_dir() -> str:
    """Packed blocks of the embedded corpus's first file at SEQ_LEN (Ray must be initialized on first use)."""
    from pipeline.data.config import DataConfig
    from pipeline.data.prepared import prepare_blocks
    from pipeline.data.tokenizer import load_tokenizer

    cfg = DataConfig(seq_len=SEQ_LEN, max_files=1, output_dir=str(REPO / "outputs"), row_group_blocks=ROW_GROUP_BLOCKS)
    sha = load_tokenizer(cfg).sha256[:10]
    out = CACHE / f"packed-embedded-f1-{sha}-L{SEQ_LEN}-rg{ROW_GROUP_BLOCKS}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # another pytest worker may be preparing the same cache
        if not (out / "manifest.json").exists():
            prepare_blocks(cfg, out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["blocks"] > 500 and manifest["splits"]["val"]["blocks"] > 8
    return str(out)


def share_block_sums(packed_dir: str, world: int) -> list:
    """Per rank, the token sum of each block of its share of the prepared train split, in its order (read with
    pyarrow from the row groups dealt to it): what the trace's block_sums must show rank r trained on."""
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.data.config import DataConfig
    from pipeline.data.shards import input_shares

    cfg = DataConfig(seq_len=SEQ_LEN, max_files=1, output_dir=str(REPO / "outputs"), packed_dir=packed_dir)
    out = []
    for share in input_shares(cfg, world)["train"].ranks:
        tables = [pq.ParquetFile(p.path).read_row_group(p.row_group, columns=["tokens"]) for p in share]
        tokens = np.concatenate([t.column("tokens").combine_chunks().flatten().to_numpy() for t in tables])
        out.append(tokens.reshape(-1, SEQ_LEN + 1).astype(np.int64).sum(axis=1))
    return out


def run_overrides(tmp_path: Path, name: str, packed_dir: str, *extra: str) -> list[str]:
    """A 6-step, 2-worker run of the small model under tmp_path (its own Ray storage and MLflow store)."""
    return [*SMALL_MODEL, f"data.seq_len={SEQ_LEN}", f"data.packed_dir={packed_dir}", "data.max_files=1",
            f"data.output_dir={REPO / 'outputs'}",
            "train.global_batch=8", "train.micro_batch=2", "train.max_steps=6", "train.warmup_steps=2",
            "train.log_every=1", "train.val_every=3", "train.val_batches=1", "train.checkpoint_every=3",
            f"train.run_name={name}", f"train.storage_path={tmp_path / 'ray_results'}", "train.debug.trace=true",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.system_metrics_interval_s=1",
            *extra]


def trace(run_dir: str, rank: int) -> list[dict]:
    path = Path(run_dir) / "trace" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses_by_step(run_dir: str) -> dict[int, float]:
    """rank 0's loss per step ("skipped" for a non-finite step); a step run again must give the same loss."""
    out: dict[int, float | str] = {}
    for rec in trace(run_dir, 0):
        loss = rec["loss"] if rec["finite"] else "skipped"
        if rec["step"] in out:
            assert loss == out[rec["step"]], f"step {rec['step']} gave another loss when run again"
        out[rec["step"]] = loss
    return out
