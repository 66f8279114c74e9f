"""The very small sweep that tests/test_tune_sweep.py runs (no tests here, and no Ray import, so that a test
starting its own Ray client can import it first)."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = "test-tune-sweep"

# Small enough for 2 shared cores: 1 layer of width 64, 128-token sequences, 4 steps of 4 blocks, 1 worker.
# At 128 tokens, sel_block=16 makes 8 blocks (n=4 is sparse, n=8 selects them all) and sel_block=32 makes 4
# (n=4 and n=8 both select them all).
OVERRIDES = [
    "model.n_layers=1", "model.dim=64", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=32",
    "model.max_seq_len=128", "data.seq_len=128",
    "train.num_workers=1", "train.global_batch=4", "train.micro_batch=4", "train.warmup_steps=1",
    "train.log_every=1", "train.val_every=2", "train.val_batches=1", "train.checkpoint_every=1",
    f"tracking.experiment={EXPERIMENT}",
    "tune.token_budget=2048",  # 4 steps of 4 x 128 tokens
    "tune.throughput_warmup_steps=1", "tune.grace_period=2", "tune.max_concurrent_trials=null",
]
