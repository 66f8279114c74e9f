"""The embedded corpus's "installed" scope on a fake site-packages folder: what is gathered, what is
skipped (counted by reason), deduplication, deterministic files whatever the number of parsing processes."""

import json

import pyarrow.parquet as pq
import pytest

from pipeline.data import corpus
from pipeline.data.config import DataConfig
from pipeline.data.corpus_sources import MAX_FILE_BYTES
from pipeline.data.source import list_source_files
from pipeline.data.tokenizer import embedded_tokenizer_path

PROSE = ("The sparse attention layer selects a few blocks of keys for every query, so that the cost of "
         "attention grows slowly with the length of the context. ") * 4
MIT = "The MIT License\n\nPermission is hereby granted, free of charge, to any person obtaining a copy " * 4


def fake_site_packages(root):
    """A site-packages folder with one file for every rule of corpus_sources.package_document."""
    files = {
        "pkg/__init__.py": f'"""{PROSE}"""\n\ndef f():\n    """{PROSE}"""\n',
        "pkg/core.py": f'class Block:\n    """{PROSE} Blocks."""\n',
        "pkg/short.py": '"""Too short."""\n',
        "pkg/broken.py": f'"""{PROSE}"""\ndef (:\n',  # unparsable
        "pkg/README.md": f"# pkg\n\n{PROSE}\n",
        "pkg/docs/notes.txt": MIT,  # licence text under another name
        "pkg/LICENSE.txt": PROSE,  # licence by its name
        "pkg/vocab.txt": "\n".join(["token"] * 100),  # bookkeeping by its name
        "pkg/table.txt": "\n".join(f"{i} {i * i}" for i in range(200)),  # data, not prose
        "pkg/tests/test_core.py": f'"""{PROSE}"""\n',  # tests are never read
        "other/README.rst": f"# pkg\n\n{PROSE}\n",  # same text as pkg/README.md: a duplicate
        "fake-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: fake\n\n{PROSE} Metadata.\n",
        "fake-1.0.dist-info/licenses/LICENSE": MIT,  # dist-info holds only METADATA for us
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "pkg/bad_utf8.py").write_bytes(b'"""\xff\xfe not utf-8 """\n' * 20)  # unreadable
    (root / "pkg/huge.md").write_text("word " * (MAX_FILE_BYTES // 5 + 1))  # too large
    return root


@pytest.fixture
def fake_installed(tmp_path, monkeypatch):
    site = fake_site_packages(tmp_path / "site-packages")
    stdlib_few = corpus.stdlib_files()[:3]  # a few real stdlib modules keep the test fast
    monkeypatch.setattr(corpus, "site_package_dirs", lambda: [site])
    monkeypatch.setattr(corpus, "stdlib_files", lambda: stdlib_few)
    return tmp_path


def read_texts(folder):
    return [t for f in sorted(folder.glob("*.parquet")) for t in pq.read_table(f).column("text").to_pylist()]


def test_installed_scope_gathers_package_docs_and_counts_skips(fake_installed):
    folder = corpus.ensure_corpus(str(fake_installed / "out"), "installed", progress=False, workers=1)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert folder.name == f"corpus-installed-{corpus.corpus_key('installed')}"
    by_source = {k: v["documents"] for k, v in manifest["by_source"].items()}
    assert by_source["package-docstring"] == 2 and by_source["package-doc"] == 1
    assert by_source["package-metadata"] == 1
    assert manifest["skipped"] == {"bookkeeping_file": 1, "duplicate": 1, "licence_file": 1, "licence_text": 1,
                                   "not_prose": 1, "too_large": 1, "unparsable": 1, "unreadable": 1}
    texts = read_texts(folder)
    assert len(texts) == manifest["documents"] and sum(map(len, texts)) == manifest["chars"]
    assert not any("Permission is hereby granted" in t for t in texts)
    assert any(t.startswith("pkg.__init__\n\n" + PROSE[:40]) for t in texts)  # module page: name, then docstrings
    assert any(t.startswith(PROSE[:40]) and t.endswith("Metadata.") for t in texts)
    # The pipeline reads it through the config's scope.
    cfg = DataConfig(embedded_scope="installed", output_dir=str(fake_installed / "out"))
    _, files = list_source_files(cfg)
    assert sorted(files) == sorted(str(p) for p in folder.glob("*.parquet"))
    assert pq.read_schema(files[0]).names == corpus.SCHEMA.names


def test_installed_corpus_is_the_same_whatever_the_number_of_processes(fake_installed):
    one = corpus.ensure_corpus(str(fake_installed / "a"), "installed", progress=False, workers=1)
    two = corpus.ensure_corpus(str(fake_installed / "b"), "installed", progress=False, workers=2)
    assert corpus.corpus_sha256(one) == corpus.corpus_sha256(two)
    ids = [i for f in sorted(one.glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()]
    assert len(set(ids)) == len(ids)


def test_scope_keys_the_corpus_and_tokenizer_caches(tmp_path):
    stdlib, installed = DataConfig(output_dir=str(tmp_path)), DataConfig(output_dir=str(tmp_path),
                                                                         embedded_scope="installed")
    assert corpus.corpus_dir(str(tmp_path)) == tmp_path.resolve() / "corpus"  # unchanged default
    assert corpus.corpus_dir(str(tmp_path), "installed") != corpus.corpus_dir(str(tmp_path))
    assert embedded_tokenizer_path(stdlib) == tmp_path.resolve() / "tokenizer" / "tokenizer.json"
    assert embedded_tokenizer_path(installed) != embedded_tokenizer_path(stdlib)
    with pytest.raises(ValueError, match="scope"):
        corpus.ensure_corpus(str(tmp_path), "everything")
