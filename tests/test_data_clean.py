"""Cleaning, file listing and the id-hash split, on FineWeb-Edu-schema Parquet (no Ray)."""

import pytest

from pipeline.data.cleaning import clean_batch, split_text
from pipeline.data.config import DataConfig
from pipeline.data.source import list_source_files, read_file_batches
from pipeline.data.split import in_split
from pipeline.data.stats import DataStats
from test_data_fixtures import fineweb_rows, write_corpus, write_fineweb

TEN_MB = 10 * 1024 * 1024


@pytest.fixture
def bad_file(tmp_path):
    rows = fineweb_rows("bad", 8, seed=1)
    raw = [r["text"].encode() for r in rows]
    raw[1] = None  # null text
    raw[2] = b""  # empty
    raw[3] = b" \n\t "  # whitespace only
    raw[4] = b"caf\xc3\xa9 ok then \xff\xfe broken bytes"  # invalid UTF-8
    raw[5] = (b"word " * (TEN_MB // 5))  # a 10 MB document
    rows[6]["int_score"] = 1  # below the threshold used below
    return write_fineweb(tmp_path / "bad.parquet", rows, raw_text=raw)


def clean_file(path, cfg):
    fs, files = list_source_files(cfg)
    stats, texts = DataStats(), []
    for batch in read_file_batches(fs, files[0], cfg):
        texts += clean_batch(batch, cfg, "train", stats)
    return texts, stats


def test_bad_rows_are_dropped_or_repaired_and_counted(bad_file):
    cfg = DataConfig(source=str(bad_file), val_fraction=0.0, min_int_score=2, max_doc_chars=1_000_000)
    texts, stats = clean_file(bad_file, cfg)
    assert stats.documents_read == 8
    assert dict(stats.dropped) == {"null_text": 1, "empty_text": 2, "low_int_score": 1}
    assert dict(stats.altered) == {"invalid_utf8": 1, "split_long": 1}
    assert stats.documents_kept == 4
    assert any(t.startswith("café ok then \ufffd") for t in texts)
    long_pieces = [t for t in texts if t.startswith("word word")]
    assert len(long_pieces) == stats.pieces - 3 and all(len(p) <= 1_000_000 for p in long_pieces)
    assert "".join(long_pieces) == "word " * (TEN_MB // 5)  # split, nothing lost


def test_missing_text_column_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"id": ["a"], "content": ["hello"]}), path)
    cfg = DataConfig(source=str(path))
    fs, files = list_source_files(cfg)
    with pytest.raises(ValueError, match=r"no_text\.parquet.*no column\(s\) \['text'\]"):
        next(read_file_batches(fs, files[0], cfg))


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list_source_files(DataConfig(source=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="no .parquet files"):
        list_source_files(DataConfig(source=str(tmp_path)))


def test_language_score_threshold(tmp_path):
    rows = fineweb_rows("lang", 20, seed=3)
    path = write_fineweb(tmp_path / "lang.parquet", rows)
    cfg = DataConfig(source=str(path), val_fraction=0.0, min_language_score=0.75)
    texts, stats = clean_file(path, cfg)
    expected_low = sum(r["language_score"] < 0.75 for r in rows)
    assert 0 < expected_low < 20
    assert stats.dropped["low_language_score"] == expected_low and len(texts) == 20 - expected_low


def test_split_text_respects_the_limit_and_loses_nothing():
    text = "alpha beta gamma\n" * 500
    pieces = split_text(text, 100)
    assert "".join(pieces) == text and all(len(p) <= 100 for p in pieces)
    assert split_text("x" * 250, 100) == ["x" * 100, "x" * 100, "x" * 50]  # no whitespace: hard cuts


def test_file_order_is_seeded(tmp_path):
    write_corpus(tmp_path, files=6, docs_per_file=1)
    order = lambda seed: list_source_files(DataConfig(source=str(tmp_path), shuffle_seed=seed))[1]
    assert order(1) == order(1)
    assert sorted(order(1)) == sorted(order(2)) and order(1) != order(2)


def test_split_is_deterministic_disjoint_and_stable_when_files_are_added(tmp_path):
    ids = [f"<urn:doc-{i}>" for i in range(4000)]
    val = in_split(ids, "val", 0.1)
    assert (val == in_split(ids, "val", 0.1)).all()
    assert (val ^ in_split(ids, "train", 0.1)).all()  # every document in exactly one split
    assert 0.08 < val.mean() < 0.12
    # Adding a file: the documents already there keep their split (membership depends on the id only).
    write_corpus(tmp_path, files=2, docs_per_file=50)
    cfg = DataConfig(source=str(tmp_path), val_fraction=0.2)

    def val_texts(cfg=cfg):  # through the cleaning step the pipeline uses
        fs, files = list_source_files(cfg)
        return {t for path in files for batch in read_file_batches(fs, path, cfg)
                for t in clean_batch(batch, cfg, "val", DataStats())}

    before = val_texts()
    assert val_texts(cfg.replace(shuffle_seed=5, read_batch_rows=7)) == before  # not a matter of position
    write_fineweb(tmp_path / "part-new.parquet", fineweb_rows("new", 50, seed=9))
    after = val_texts()
    assert before and after > before  # old validation documents all still there, new ones added


def test_fsspec_uri_source_reads_the_same_documents(tmp_path):
    """A URI source goes through fsspec (s3://, gs://, ... are fsspec filesystems too): here its in-memory one."""
    import uuid

    import fsspec

    local = write_corpus(tmp_path / "src", files=3, docs_per_file=20)
    fs = fsspec.filesystem("memory")
    root = f"/nsa-test-{uuid.uuid4().hex[:8]}/fineweb"
    try:
        for f in sorted(local.glob("*.parquet")):
            fs.pipe(f"{root}/sub/{f.name}", f.read_bytes())
        fs.pipe(f"{root}/README.md", b"not parquet")  # ignored: only .parquet files are read

        def documents(cfg):
            fs_, files = list_source_files(cfg)
            texts = [t for p in files for b in read_file_batches(fs_, p, cfg) for t in clean_batch(b, cfg, "train",
                                                                                                 DataStats())]
            return files, texts

        remote_files, remote = documents(DataConfig(source=f"memory://{root}", val_fraction=0.2, shuffle_seed=4))
        local_files, expected = documents(DataConfig(source=str(local), val_fraction=0.2, shuffle_seed=4))
        assert [p.rsplit("/", 1)[1] for p in remote_files] == [p.rsplit("/", 1)[1] for p in local_files]
        assert all(p.startswith(f"{root}/sub/") for p in remote_files)
        assert remote == expected and len(remote) > 40
    finally:
        fs.rm(root.split("/fineweb")[0], recursive=True)


def test_uri_source_without_its_filesystem_package_is_a_clear_error(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed (it is not a dependency)
    with pytest.raises(ValueError, match=r"DataConfig.source: reading 's3://bucket/fineweb' needs a filesystem "
                                         r"package that is not installed: .*s3fs"):
        list_source_files(DataConfig(source="s3://bucket/fineweb"))


def test_only_the_needed_columns_are_read(tmp_path):
    path = write_fineweb(tmp_path / "cols.parquet", fineweb_rows("cols", 5, seed=2))
    cfg = DataConfig(source=str(path))
    fs, files = list_source_files(cfg)
    assert next(read_file_batches(fs, files[0], cfg)).schema.names == ["text", "id"]
    cfg = cfg.replace(min_int_score=3, min_language_score=0.5)
    assert next(read_file_batches(fs, files[0], cfg)).schema.names == ["text", "id", "int_score", "language_score"]
