"""The data stage: text (Parquet, FineWeb-Edu schema) -> tokens -> packed blocks.

    from pipeline.data import DataConfig, load_tokenizer, block_dataset, iter_rank_batches, StatsRecorder

    tok = load_tokenizer(cfg)                      # .vocab_size, .eos_id, .encode_batch, .name, .sha256
    rec = StatsRecorder()
    ds = block_dataset(cfg, "train", start_block=next_block, stats=rec)   # ray.data.Dataset, index order
    # driver: TorchTrainer(..., datasets={"train": ds}, dataset_config=train_data_config())
    # worker: for tokens, idx in iter_rank_batches(ray.train.get_dataset_shard("train"), rank=r,
    #                                              world_size=W, batch_size=b, start_block=next_block): ...
    rec.snapshot()                                 # DataStats: documents, drops/alterations, tokens, blocks
"""

from pipeline.data.config import DataConfig
from pipeline.data.dataset import block_dataset, resolved_config
from pipeline.data.loader import iter_rank_batches, train_data_config
from pipeline.data.prepared import default_packed_dir, prepare_blocks, prepared_stats, read_manifest
from pipeline.data.stats import DataStats, StatsRecorder
from pipeline.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "DataConfig", "DataStats", "StatsRecorder", "Tokenizer", "block_dataset", "default_packed_dir",
    "iter_rank_batches", "load_tokenizer", "prepare_blocks", "prepared_stats", "read_manifest",
    "resolved_config", "train_bpe", "train_data_config",
]
