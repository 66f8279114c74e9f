"""The data stage: text (Parquet, FineWeb-Edu schema) -> tokens -> packed blocks.

    from pipeline.data import DataConfig, load_tokenizer, block_dataset, iter_rank_batches, StatsRecorder

    tok = load_tokenizer(cfg)                      # .vocab_size, .eos_id, .encode_batch, .name, .sha256
    rec = StatsRecorder()
    shares = input_shares(cfg, W)                  # per split: its pieces dealt to W ranks (disjoint, seeded)
    ds = block_datasets(cfg, "train", world_size=W, stats=rec, shares=shares["train"])  # one per rank
    # driver: TorchTrainer(..., datasets={rank_dataset_name("train", r): ds[r] ...},
    #                      dataset_config=train_data_config())
    # worker r: for tokens, pos in iter_rank_batches(ray.train.get_dataset_shard(rank_dataset_name("train", r)),
    #                                                batch_size=b, start_block=blocks_done, wrap=True): ...
    rec.snapshot()                                 # DataStats summed over ranks; rec.snapshot(part=r): rank r's
    block_dataset(cfg, "train")                    # world_size=1: the whole split, indexed split-wide
"""

from pipeline.data.config import DataConfig
from pipeline.data.dataset import block_dataset, block_datasets, resolved_config
from pipeline.data.loader import iter_rank_batches, rank_dataset_name, train_data_config
from pipeline.data.prepared import default_packed_dir, prepare_blocks, prepared_stats, read_manifest
from pipeline.data.shards import Shares, input_shares
from pipeline.data.stats import DataStats, StatsRecorder
from pipeline.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "DataConfig", "DataStats", "Shares", "StatsRecorder", "Tokenizer", "block_dataset", "block_datasets",
    "default_packed_dir", "input_shares", "iter_rank_batches", "load_tokenizer", "prepare_blocks", "prepared_stats",
    "rank_dataset_name", "read_manifest", "resolved_config", "train_bpe", "train_data_config",
]
