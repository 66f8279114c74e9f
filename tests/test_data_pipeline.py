"""The Ray Data pipeline end to end on a small FineWeb-Edu-schema corpus: token conservation, prepared
shards, per-rank shares (each rank reads only its own fragments or row groups), equal step counts on uneven
shares, exact resume, and the hub path through a local fsspec stand-in."""

import itertools
import logging
import os
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import ray

from pipeline.data import (DataConfig, StatsRecorder, block_dataset, block_datasets, input_shares,
                           iter_rank_batches, load_tokenizer, prepare_blocks, read_manifest, train_bpe)
from pipeline.data.cleaning import clean_batch
from pipeline.data.shards import deal
from pipeline.data.source import list_source_files, needed_columns, read_file_batches
from pipeline.data.stats import DataStats
from test_data_fixtures import fineweb_rows, write_corpus, write_fineweb

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time (pyproject.toml)

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
    # 3 files of 3 row groups (25, 25, 10 rows) and one of 1: 10 (file, row group) fragments in 4 files
    write_corpus(root / "src", files=3, docs_per_file=60, row_group_rows=25)
    rows = fineweb_rows("odd", 6, seed=7)
    raw = [r["text"].encode() for r in rows]
    raw[0], raw[1], raw[2] = None, b"   ", b"bad \xff utf8 " * 3
    raw[3] = b"long words " * 400  # 4400 chars > max_doc_chars below: split in pieces
    write_fineweb(root / "src" / "part-odd.parquet", rows, raw_text=raw)
    tok = train_bpe((r["text"] for r in fineweb_rows("tok", 200, seed=11)), 300, root / "tok" / "tokenizer.json")
    cfg = DataConfig(source=str(root / "src"), tokenizer=str(tok), seq_len=SEQ_LEN, val_fraction=0.2,
                     max_doc_chars=1000, read_batch_rows=16, shuffle_seed=3, output_dir=str(root / "out"),
                     shard_blocks=40, row_group_blocks=16)
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


def source_fragments(cfg):
    """[(path, row group, rows)] of the source in the seeded file order, read with pyarrow."""
    _, files = list_source_files(cfg)
    out = []
    for path in files:
        meta = pq.ParquetFile(path).metadata
        out += [(path, rg, meta.row_group(rg).num_rows) for rg in range(meta.num_row_groups)]
    return out


def fragment_stream(cfg, path, row_group, split):
    """One fragment's token stream computed directly (pyarrow's read_row_group, cleaning, encode_batch, EOS)."""
    tok = load_tokenizer(cfg)
    table = pq.ParquetFile(path).read_row_group(row_group, columns=needed_columns(cfg))
    stream = []
    for ids in tok.encode_batch(clean_batch(table, cfg, split, DataStats())):
        stream += ids + [tok.eos_id]
    return np.array(stream, dtype=np.int64)


def prepared_row_groups(packed_cfg, split):
    """[(path, row group, first split-wide block index, blocks)] of the prepared split, read with pyarrow."""
    out, first = [], 0
    for shard in read_manifest(packed_cfg.packed_dir)["splits"][split]["shards"]:
        path = os.path.join(packed_cfg.packed_dir, shard["path"])
        meta = pq.ParquetFile(path).metadata
        for rg in range(meta.num_row_groups):
            out.append((path, rg, first, meta.row_group(rg).num_rows))
            first += meta.row_group(rg).num_rows
    return out


def collect(ds):
    batches = list(ds.iter_batches(batch_size=50, batch_format="numpy"))
    return (np.concatenate([b["index"] for b in batches]), np.concatenate([b["tokens"] for b in batches]))


def take(batches, n):
    """The first n (tokens, positions) of a rank's batch iterator, as numpy arrays; closes the iterator."""
    got = list(itertools.islice(batches, n))
    batches.close()
    return np.concatenate([x.numpy() for x, _ in got]), np.concatenate([pos for _, pos in got])


def dealt(shares):
    return [[(p.path, p.row_group) for p in share] for share in shares.ranks]


@pytest.fixture(scope="module")
def streamed_train(ray_local, corpus):
    recorder = StatsRecorder()
    index, tokens = collect(block_dataset(corpus, "train", stats=recorder))
    return index, tokens, recorder.snapshot()


@pytest.fixture(scope="module")
def streamed_ranks(ray_local, corpus):
    """world -> (the train shares, per rank (index, tokens) of its whole stream, per rank its DataStats)."""
    cache = {}

    def get(world):
        if world not in cache:
            shares = input_shares(corpus, world)["train"]
            recorder = StatsRecorder()
            data = [collect(ds) for ds in block_datasets(corpus, "train", world_size=world, stats=recorder,
                                                         shares=shares)]
            cache[world] = shares, data, [recorder.snapshot(part=r) for r in range(world)]
        return cache[world]

    return get


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
    assert stats.fragments_read == len(source_fragments(corpus)) == 10


def test_the_stream_is_built_with_no_deprecated_ray_data_argument(ray_local, corpus):
    """Ray Data 2.51+ logs a deprecation for map_batches(concurrency=...) (seen in every GPU pipeline log until
    stop 38); the tokenize stage passes its task count as compute=TaskPoolStrategy(size=...) instead."""
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    ray_data_log = logging.getLogger("ray.data")
    ray_data_log.addHandler(handler)
    try:
        block_dataset(corpus, "train")  # builds the plan: map_batches resolves its compute strategy here
    finally:
        ray_data_log.removeHandler(handler)
    assert [r.getMessage() for r in records if "deprecated" in r.getMessage()] == []


def test_the_tokenize_stage_runs_no_more_tasks_than_a_rank_has_fragments(ray_local, corpus):
    """More tokenize tasks asked for than a rank has fragments: the stage takes one per fragment, so Ray Data has
    no unusable concurrency to warn about (seen for the small validation shares on the GPU hosts, stop 38)."""
    cfg = corpus.replace(tokenize_tasks=64)  # the corpus has 10 fragments
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        index, _ = collect(block_dataset(cfg, "train"))
    assert len(index) > 0
    assert [str(w.message) for w in caught if "concurrent tasks" in str(w.message)] == []


def test_prepared_blocks_are_read_by_at_most_read_tasks_tasks(packed, monkeypatch):
    """The read stage of prepared blocks runs a fixed pool of data.read_tasks tasks (fewer where a share has fewer
    row groups). Left to Ray Data, it started a worker process for every quarter CPU free, 41-45 on a 16-CPU cluster
    with 5 held (bench/probe_read_tasks.py), at the time a run compiles its kernels."""
    asked = []
    map_batches = ray.data.Dataset.map_batches

    def spy(self, fn, *args, **kwargs):
        asked.append((getattr(fn, "__name__", fn), kwargs.get("compute")))
        return map_batches(self, fn, *args, **kwargs)

    monkeypatch.setattr(ray.data.Dataset, "map_batches", spy)
    row_groups = len(prepared_row_groups(packed, "train"))
    assert row_groups > 3
    for read_tasks, want in ((3, 3), (row_groups + 5, row_groups)):
        asked.clear()
        block_dataset(packed.replace(read_tasks=read_tasks), "train")
        [(name, compute)] = asked
        assert name == "read_pieces"
        assert isinstance(compute, ray.data.TaskPoolStrategy) and compute.size == want, compute


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


def test_deal_is_greedy_by_size_deterministic_and_near_equal():
    assert deal([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert deal([3, 3, 3, 3, 1, 1, 1], 3) == [[0, 3], [1, 4, 6], [2, 5]]  # ties go to the lowest rank
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(0, 100, size=int(rng.integers(1, 40))).tolist()
        world = int(rng.integers(1, 9))
        shares = deal(sizes, world)
        assert shares == deal(sizes, world)
        assert sorted(i for share in shares for i in share) == list(range(len(sizes)))  # a partition
        assert all(share == sorted(share) for share in shares)  # each share keeps the list order
        totals = [sum(sizes[i] for i in share) for share in shares]
        assert max(totals) - min(totals) <= max(sizes)  # near-equal: within one piece


@pytest.mark.parametrize("world", [3, 5])
def test_each_rank_streams_only_its_own_fragments_and_together_every_token_once(corpus, streamed_ranks, world):
    """Rank r's pipeline reads, tokenizes and packs exactly the (file, row group) fragments dealt to it: its
    blocks are those fragments' documents packed in order, its counts are theirs alone; over all ranks every
    fragment is read once and every document's tokens are in exactly one rank's stream. world=5 > 4 files.
    (world=2, which checks nothing that world=3 does not, was left out for CI time.)"""
    shares, data, stats = streamed_ranks(world)
    n = corpus.block_len
    fragments = source_fragments(corpus)
    rows = {(path, rg): r for path, rg, r in fragments}
    assert [(p.path, p.row_group) for p in shares.pieces] == [(path, rg) for path, rg, _ in fragments]
    mine = dealt(shares)
    assert sorted(k for share in mine for k in share) == sorted(rows)  # disjoint, and together all of them
    assert all(mine)
    if world == 5:  # more ranks than files: a file's row groups go to different ranks
        owners = {}
        for r, share in enumerate(mine):
            for path, _ in share:
                owners.setdefault(path, set()).add(r)
        assert any(len(ranks) > 1 for ranks in owners.values())
    sizes = shares.sizes()
    assert max(sizes) - min(sizes) <= max(p.size for p in shares.pieces)  # near-equal shares (text bytes)

    streams = {k: fragment_stream(corpus, *k, "train") for k in rows}
    full, _ = reference_stream(corpus, "train")
    assert np.array_equal(np.concatenate([streams[path, rg] for path, rg, _ in fragments]), full)
    total = 0
    for r in range(world):
        index, tokens = data[r]
        ref = np.concatenate([streams[k] for k in mine[r]])  # rank r's own fragments, in order
        assert index.tolist() == list(range(len(ref) // n))  # indexed by position in the rank's own stream
        assert np.array_equal(tokens.reshape(-1), ref[: len(index) * n])
        s = stats[r]  # what rank r's pipeline read: its fragments, each once, and no other row
        assert s.fragments_read == len(mine[r])
        assert s.documents_read + s.documents_other_split == sum(rows[k] for k in mine[r])
        assert s.blocks == len(index) and s.blocks * n + s.partial_block_tokens == len(ref)
        total += s.document_tokens + s.eos_tokens
    assert total == len(full)  # every document's tokens (and its EOS) once, over all ranks


def test_more_ranks_than_fragments_is_refused_naming_the_source(corpus):
    with pytest.raises(ValueError, match=r"DataConfig.source .*10 piece\(s\) .* for 11 training workers"):
        input_shares(corpus, 11)


def test_each_rank_reads_only_its_own_prepared_row_groups(packed, packed_train):
    world = 3  # world=2, which checks nothing that 3 does not, was left out for CI time (about 150 s on 2 cores)
    shares = input_shares(packed, world)["train"]
    groups = prepared_row_groups(packed, "train")
    assert len(groups) > len({path for path, *_ in groups})  # shards of several row groups, dealt one by one
    assert [(p.path, p.row_group) for p in shares.pieces] == [(path, rg) for path, rg, *_ in groups]
    where = {(path, rg): (first, blocks) for path, rg, first, blocks in groups}
    mine = dealt(shares)
    assert sorted(k for share in mine for k in share) == sorted(where) and all(mine)
    sizes = shares.sizes()
    assert max(sizes) - min(sizes) <= max(blocks for *_, blocks in groups)
    _, all_tokens = collect(packed_train)  # the whole split, split-wide index order
    seen = []
    for r in range(world):
        index, tokens = collect(block_dataset(packed, "train", rank=r, world_size=world))
        want = np.concatenate([np.arange(where[k][0], where[k][0] + where[k][1]) for k in mine[r]])
        assert index.tolist() == list(range(len(want)))
        assert np.array_equal(tokens, all_tokens[want])  # exactly its row groups' blocks, in order
        seen += want.tolist()
    assert sorted(seen) == list(range(len(all_tokens)))  # every prepared block in exactly one share


def test_uneven_shares_give_every_rank_the_same_steps_by_wrapping(packed):
    """The shares differ in size; a rank whose share runs out continues into its next epoch (the same blocks in
    the same order, positions still counting), so every rank yields as many batches as the run takes."""
    world, b = 3, 4
    sizes = input_shares(packed, world)["train"].sizes()
    assert len(set(sizes)) > 1
    steps = max(sizes) // b + 3  # past the end of every share
    for r in range(world):
        _, epoch = collect(block_dataset(packed, "train", rank=r, world_size=world))
        assert len(epoch) == sizes[r]
        wrapped = []
        x, pos = take(iter_rank_batches(block_dataset(packed, "train", rank=r, world_size=world), batch_size=b,
                                        wrap=True, on_epoch=lambda e, blocks: wrapped.append((e, blocks))),
                      steps)
        assert pos.tolist() == list(range(steps * b))  # the same number of batches on every rank
        assert np.array_equal(x, epoch[pos % sizes[r]].astype(np.int64))
        assert wrapped == [(e, e * sizes[r]) for e in range(1, (steps * b - 1) // sizes[r] + 1)]


def test_a_streaming_rank_wraps_into_the_same_stream_again(corpus, streamed_ranks):
    world, rank, b = 5, 4, 8
    _, data, _ = streamed_ranks(world)
    index, epoch = data[rank]
    steps = len(index) // b + 2
    x, pos = take(iter_rank_batches(block_dataset(corpus, "train", rank=rank, world_size=world), batch_size=b,
                                    wrap=True), steps)
    assert pos.tolist() == list(range(steps * b))
    assert np.array_equal(x, epoch[pos % len(index)].astype(np.int64))  # re-read, re-tokenized, identical


@pytest.mark.parametrize("mode", ["prepared", "streaming"])
def test_resume_is_exact_per_rank_across_an_epoch_boundary(mode, corpus, packed, streamed_ranks):
    """Consume k batches of rank 2's stream, "crash", resume at the checkpoint's position k*b (what the trainer
    does: the dataset from the start, the loader skipping; and a dataset built from that position): the
    blocks are exactly the straight run's, across the end of the rank's first epoch, none lost or repeated."""
    world, rank, b = 3, 2, 4
    cfg = packed if mode == "prepared" else corpus
    if mode == "prepared":
        _, epoch = collect(block_dataset(cfg, "train", rank=rank, world_size=world))
    else:
        _, epoch = streamed_ranks(world)[1][rank]
    size = len(epoch)
    k = size // b - 1  # the crash: k batches done, the first epoch not over
    m = 4  # then m more: into the second epoch

    def batches(start, dataset_start=0, wrap=True):
        ds = block_dataset(cfg, "train", rank=rank, world_size=world, start_block=dataset_start)
        return iter_rank_batches(ds, batch_size=b, start_block=start, wrap=wrap)

    x1, p1 = take(batches(0), k)
    start = k * b
    x2, p2 = take(batches(start), m)
    pos = np.concatenate([p1, p2])
    assert pos.tolist() == list(range((k + m) * b)) and pos[-1] >= size  # no gap, no repeat, past the wrap
    assert np.array_equal(np.concatenate([x1, x2]), epoch[pos % size].astype(np.int64))
    # A dataset built from the resume position (prepared: the row groups before it are never opened).
    x3, p3 = take(batches(start, dataset_start=start, wrap=False), 1)
    assert p3.tolist() == list(range(start, start + b)) and np.array_equal(x3, epoch[p3].astype(np.int64))
    # Resuming in the second epoch.
    x4, p4 = take(batches(size + 2 * b), 1)
    assert p4.tolist() == list(range(size + 2 * b, size + 3 * b))
    assert np.array_equal(x4, epoch[2 * b: 3 * b].astype(np.int64))


def test_hub_source_through_a_local_fsspec_stand_in_and_streaming_resume(corpus, streamed_train, streamed_ranks,
                                                                        monkeypatch, tmp_path):
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
    # A rank's share through the hub's filesystem: its fragments, from position 5 on.
    shares = input_shares(cfg, 2)["train"]
    assert [(p.path, p.row_group) for p in shares.pieces] == [(f, rg) for f in files for rg in range(
        pq.ParquetFile(str(tmp_path / "hub" / f)).metadata.num_row_groups)]
    r_index, r_tokens = collect(block_dataset(cfg, "train", rank=1, world_size=2, start_block=5))
    index, tokens = streamed_ranks(2)[1][1]
    assert np.array_equal(r_index, index[5:]) and np.array_equal(r_tokens, tokens[5:])


class _Epochs:
    """A stand-in for a rank's DataIterator: each iteration (epoch) yields the next list of block indices."""

    def __init__(self, *epochs):
        self.epochs, self.calls = list(epochs), 0

    def iter_batches(self, **_):
        assert self.calls < 100, "iterated the stream 100 times: an endless loop over empty epochs"
        index = self.epochs[min(self.calls, len(self.epochs) - 1)]
        self.calls += 1
        if index:
            yield {"index": np.array(index), "tokens": np.zeros((len(index), 5), np.uint16)}


def test_out_of_order_stream_is_an_error():
    with pytest.raises(RuntimeError, match="out of order"):
        list(iter_rank_batches(_Epochs([0, 1, 3, 2]), batch_size=2))


@pytest.mark.parametrize("epochs, kwargs, message", [
    (([0, 1, 2], [1, 2]), {"wrap": True}, "epoch 1 starts at block 1, expected 0"),  # a lost block at the wrap
    (([1, 2, 3],), {"wrap": True, "start_block": 1}, "epoch 0 starts at block 1, expected 0"),
    (([5, 6],), {"start_block": 2}, "starts at block 5, expected at most 2"),  # blocks 2..4 missing
    (([0, 1, 2], [0, 1]), {"wrap": True}, "epoch 1 of this rank's stream held 2 blocks, epoch 0 held 3"),
    (([],), {"wrap": True}, "holds no full block"),
])
def test_a_wrong_stream_is_an_error(epochs, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        list(itertools.islice(iter_rank_batches(_Epochs(*epochs), batch_size=2, **kwargs), 10))
