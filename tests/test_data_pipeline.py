"""The Ray Data pipeline end to end on a small FineWeb-Edu-schema corpus: token conservation, prepared
shards, rank shares, exact resume, and the hub path through a local fsspec stand-in."""

import numpy as np
import pytest
import ray

from pipeline.data import (DataConfig, StatsRecorder, block_dataset, iter_rank_batches, load_tokenizer,
                           prepare_blocks, read_manifest, train_bpe)
from pipeline.data.cleaning import clean_batch
from pipeline.data.source import list_source_files, read_file_batches
from pipeline.data.stats import DataStats
from test_data_fixtures import fineweb_rows, write_corpus, write_fineweb

SEQ_LEN = 31  # blocks of 32 tokens: many blocks from a small corpus, documents spanning blocks


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root / "src", files=3, docs_per_file=60)
    rows = fineweb_rows("odd", 6, seed=7)
    raw = [r["text"].encode() for r in rows]
    raw[0], raw[1], raw[2] = None, b"   ", b"bad \xff utf8 " * 3
    raw[3] = b"long words " * 400  # 4400 chars > max_doc_chars below: split in pieces
    write_fineweb(root / "src" / "part-odd.parquet", rows, raw_text=raw)
    tok = train_bpe((r["text"] for r in fineweb_rows("tok", 200, seed=11)), 300, root / "tok" / "tokenizer.json")
    cfg = DataConfig(source=str(root / "src"), tokenizer=str(tok), seq_len=SEQ_LEN, val_fraction=0.2,
                     max_doc_chars=1000, read_batch_rows=16, shuffle_seed=3, output_dir=str(root / "out"),
                     shard_blocks=40)
    return cfg


def reference_stream(cfg, split):
    """The token stream computed directly: files in order, cleaning, encode_batch, EOS after each document."""
    tok = load_tokenizer(cfg)
    fs, files = list_source_files(cfg)
    stream, stats = [], DataStats()
    for path in files:
        for batch in read_file_batches(fs, path, cfg):
            for ids in tok.encode_batch(clean_batch(batch, cfg, split, stats)):
                stream += ids + [tok.eos_id]
    return np.array(stream), stats


def collect(ds):
    batches = list(ds.iter_batches(batch_size=50, batch_format="numpy"))
    return (np.concatenate([b["index"] for b in batches]), np.concatenate([b["tokens"] for b in batches]))


@pytest.fixture(scope="module")
def streamed_train(ray_local, corpus):
    recorder = StatsRecorder()
    index, tokens = collect(block_dataset(corpus, "train", stats=recorder))
    return index, tokens, recorder.snapshot()


@pytest.fixture(scope="module")
def packed(ray_local, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "p"
    prepare_blocks(corpus, out, progress=False)
    return corpus.replace(packed_dir=str(out))


@pytest.fixture(scope="module")
def packed_train(packed):
    """The prepared train split read back once (materialized, so tests iterate it without re-reading)."""
    return block_dataset(packed, "train").materialize()


def test_streamed_blocks_conserve_every_token(corpus, streamed_train):
    index, tokens, stats = streamed_train
    ref, ref_stats = reference_stream(corpus, "train")
    n = corpus.block_len
    assert tokens.dtype == np.uint16 and tokens.shape[1] == n
    assert index.tolist() == list(range(len(ref) // n))
    assert np.array_equal(tokens.reshape(-1), ref[: len(index) * n])  # same tokens, same order
    # Document tokens + one EOS per document = packed tokens + the counted final partial block.
    assert stats.document_tokens + stats.eos_tokens == len(ref) == stats.blocks * n + stats.partial_block_tokens
    assert stats.blocks == len(index) and 0 <= stats.partial_block_tokens < n
    assert stats.eos_tokens == stats.pieces == ref_stats.pieces
    assert stats.dropped == ref_stats.dropped and stats.altered == ref_stats.altered
    assert stats.documents_read + stats.documents_other_split == 3 * 60 + 6


def test_bad_rows_are_counted_in_the_stream_stats(corpus, streamed_train):
    _, _, stats = streamed_train
    _, val_stats = reference_stream(corpus, "val")
    both = DataStats()
    both.add(stats)
    both.add(val_stats)
    assert both.dropped == {"null_text": 1, "empty_text": 1}
    assert both.altered == {"invalid_utf8": 1, "split_long": 1}


def test_prepared_shards_equal_the_stream_and_the_manifest_counts(corpus, packed, packed_train, streamed_train):
    index, tokens, stats = streamed_train
    manifest = read_manifest(packed.packed_dir)
    assert manifest["tokenizer"]["sha256"] == load_tokenizer(corpus).sha256
    assert manifest["splits"]["train"]["blocks"] == len(index) and len(manifest["splits"]["train"]["shards"]) > 1
    assert DataStats.from_json(manifest["splits"]["train"]["stats"]) == stats
    p_index, p_tokens = collect(packed_train)
    assert np.array_equal(p_index, index) and np.array_equal(p_tokens, tokens)
    ref_val, _ = reference_stream(corpus, "val")
    val = manifest["splits"]["val"]
    assert val["blocks"] == len(ref_val) // corpus.block_len and val["stats"]["partial_block_tokens"] == len(ref_val) % corpus.block_len


def test_prepared_data_refuses_another_seq_len_or_tokenizer(packed):
    with pytest.raises(ValueError, match="DataConfig.seq_len"):
        block_dataset(packed.replace(seq_len=64), "train")
    with pytest.raises(ValueError, match="DataConfig.tokenizer"):
        block_dataset(packed.replace(tokenizer="bytes"), "train")


@pytest.mark.parametrize("world_size, batch_size", [(2, 3), (3, 2)])
def test_ranks_get_disjoint_equal_shares_in_step_order(packed, packed_train, world_size, batch_size):
    ds = packed_train
    total = read_manifest(packed.packed_dir)["splits"]["train"]["blocks"]
    group = world_size * batch_size
    per_rank = [list(iter_rank_batches(ds, rank=r, world_size=world_size, batch_size=batch_size))
                for r in range(world_size)]
    steps = total // group
    assert steps >= 3 and all(len(batches) == steps for batches in per_rank)  # same number of steps
    seen = []
    for r, batches in enumerate(per_rank):
        for t, (x, idx) in enumerate(batches):
            assert x.shape == (batch_size, packed.block_len) and str(x.dtype) == "torch.int64"
            assert idx.tolist() == [i for i in range(t * group, (t + 1) * group) if i % world_size == r]
            seen += idx.tolist()
    assert sorted(seen) == list(range(steps * group))  # disjoint, and together exactly the first blocks


def test_resume_is_exact(packed, packed_train, streamed_train):
    world, b, k, m = 2, 2, 3, 4
    _, all_tokens, _ = streamed_train
    first = []
    for i, (x, idx) in enumerate(iter_rank_batches(packed_train, rank=1, world_size=world, batch_size=b)):
        if i == k:
            break  # "crash" after k micro-batches
        first.append((x, idx))
    start = k * b * world  # the checkpoint's next_block
    resumed = block_dataset(packed, "train", start_block=start)
    rest = [batch for _, batch in zip(range(m), iter_rank_batches(resumed, rank=1, world_size=world, batch_size=b,
                                                                  start_block=start))]
    got = np.concatenate([idx for _, idx in first + rest])
    assert got.tolist() == [i for i in range((k + m) * b * world) if i % world == 1]  # no gap, no repeat
    x = np.concatenate([x.numpy() for x, _ in first + rest])
    assert np.array_equal(x, all_tokens[got].astype(np.int64))


def test_hub_source_through_a_local_fsspec_stand_in_and_streaming_resume(corpus, streamed_train, monkeypatch,
                                                                        tmp_path):
    import shutil
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem
    import pipeline.data.source as source

    hub_folder = tmp_path / "hub" / "datasets" / "HuggingFaceFW" / "fineweb-edu" / "sample" / "10BT"
    shutil.copytree(corpus.source, hub_folder)
    monkeypatch.setattr(source, "hub_filesystem", lambda: DirFileSystem(path=str(tmp_path / "hub"),
                                                                        fs=LocalFileSystem()))
    cfg = corpus.replace(source="hf://datasets/HuggingFaceFW/fineweb-edu/sample/10BT")
    fs, files = list_source_files(cfg)
    assert all(f.startswith("datasets/HuggingFaceFW/fineweb-edu/sample/10BT/") for f in files)
    h_index, h_tokens = collect(block_dataset(cfg, "train", start_block=10))
    index, tokens, _ = streamed_train  # the same files, so the same blocks; streaming resume skips 10
    assert np.array_equal(h_index, index[10:]) and np.array_equal(h_tokens, tokens[10:])


class _Shuffled:
    def iter_batches(self, **_):
        yield {"index": np.array([0, 1, 3, 2]), "tokens": np.zeros((4, 5), np.uint16)}


def test_out_of_order_stream_is_an_error():
    with pytest.raises(RuntimeError, match="out of order"):
        list(iter_rank_batches(_Shuffled(), rank=0, world_size=1, batch_size=2))


def test_start_block_must_be_a_micro_batch_boundary():
    with pytest.raises(ValueError, match="multiple of"):
        list(iter_rank_batches(_Shuffled(), rank=0, world_size=2, batch_size=2, start_block=3))
