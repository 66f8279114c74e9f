"""The embedded corpus: real English text that ships with Python, as FineWeb-Edu-schema Parquet.

No network, and no code imported: documents come from pipeline.data.corpus_sources. Two scopes:
  "stdlib"     the pydoc topic pages and the docstrings of every pure-Python stdlib module
               (~543 documents, ~2.3M chars) under <output_dir>/corpus/
  "installed"  the same plus, from every installed package (site-packages), module docstrings,
               documentation files and METADATA long descriptions, deduplicated by text, under
               <output_dir>/corpus-installed-<key>/, key = hash of Python's and every distribution's version
Built deterministically (sorted files, ids from the file's relative path) on first use and reused after;
the folder appears atomically, so concurrent first uses are safe. manifest.json reports documents and
characters by source, and the files skipped by reason.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pipeline.data.corpus_parse import parse_files
from pipeline.data.corpus_sources import SkipCounter, package_files, pydoc_topics, site_package_dirs, stdlib_files

SCOPES = ("stdlib", "installed")
CORPUS_VERSION = 1  # of the stdlib corpus (its files are unchanged since version 1)
INSTALLED_VERSION = 1  # of the installed-packages corpus; part of its cache key
NUM_FILES = 4  # stdlib scope
INSTALLED_FILE_CHARS = 4_000_000  # installed scope: about this many characters per Parquet file

# FineWeb-Edu's columns and types.
SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
    ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
    ("int_score", pa.int64()),
])


def check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise ValueError(f"embedded corpus scope: must be one of {SCOPES}, got {scope!r}")


def corpus_key(scope: str) -> str:
    """"" for stdlib (fixed by the Python version alone); for installed, a hash of the interpreter's and
    every installed distribution's name and version, so installing or upgrading a package rebuilds."""
    check_scope(scope)
    if scope == "stdlib":
        return ""
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                   if d.metadata["Name"])
    blob = json.dumps([INSTALLED_VERSION, sys.version, dists])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def corpus_dir(output_dir: str, scope: str = "stdlib") -> Path:
    key = corpus_key(scope)
    name = "corpus" if scope == "stdlib" else f"corpus-{scope}-{key}"
    return Path(output_dir).resolve() / name


def ensure_corpus(output_dir: str, scope: str = "stdlib", *, progress: bool = True,
                  workers: int | None = None) -> Path:
    """The embedded corpus folder (Parquet files) of `scope`, built on first use, parsing files in `workers`
    processes (default: one for stdlib, every core for installed)."""
    target = corpus_dir(output_dir, scope)
    if (target / "manifest.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".corpus-", dir=target.parent))
    try:
        if workers is None:
            workers = 1 if scope == "stdlib" else (os.cpu_count() or 1)
        manifest = _write_corpus(tmp, scope, progress, workers)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)  # atomic; fails if another process won the race
        except OSError:
            if not (target / "manifest.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(corpus_summary(manifest), file=sys.stderr)
    return target


def corpus_summary(manifest: dict) -> str:
    lines = [f"embedded corpus ({manifest['scope']}): {manifest['documents']} documents, "
             f"{manifest['chars']:,} chars in {manifest['files']} files, built in {manifest['seconds']:.0f} s"]
    for source, n in manifest["by_source"].items():
        lines.append(f"  {source}: {n['documents']} documents, {n['chars']:,} chars")
    if manifest["skipped"]:
        lines.append(f"  skipped files: {manifest['skipped']}")
    return "\n".join(lines)


def _write_corpus(folder: Path, scope: str, progress: bool, workers: int) -> dict:
    start = time.perf_counter()
    skips = SkipCounter()
    docs = list(documents(scope, skips, progress, workers))
    if scope == "stdlib":  # contiguous quarters, as since version 1
        per_file = math.ceil(len(docs) / NUM_FILES)
        parts = [docs[i * per_file:(i + 1) * per_file] for i in range(NUM_FILES)]
    else:  # striped: every file mixes all packages, so a few files (or a tokenizer sample) see them all
        chars = sum(len(d["text"]) for d in docs)
        n = max(NUM_FILES, math.ceil(chars / INSTALLED_FILE_CHARS))
        parts = [docs[i::n] for i in range(n)]
    for i, part in enumerate(parts):
        columns = {name: [d[name] for d in part] for name in SCHEMA.names}
        pq.write_table(pa.table(columns, schema=SCHEMA), folder / f"part-{i:03d}.parquet")
    by_source = defaultdict(lambda: {"documents": 0, "chars": 0})
    for d in docs:
        by_source[d["dump_source"]]["documents"] += 1
        by_source[d["dump_source"]]["chars"] += len(d["text"])
    manifest = {"version": CORPUS_VERSION if scope == "stdlib" else INSTALLED_VERSION, "scope": scope,
                "key": corpus_key(scope), "documents": len(docs), "files": len(parts),
                "chars": sum(len(d["text"]) for d in docs), "python": sys.version.split()[0],
                "by_source": dict(by_source), "skipped": dict(sorted(skips.items())),
                "seconds": round(time.perf_counter() - start, 1)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def documents(scope: str, skips: SkipCounter, progress: bool = False, workers: int = 1) -> Iterator[dict]:
    """Every document of `scope` as a FineWeb-Edu row (plus "dump_source"), in a fixed order whatever
    `workers` (processes parsing files); a text seen before (a vendored copy, a README shipped twice) is
    skipped and counted as a duplicate."""
    check_scope(scope)
    seen: set[bytes] = set()

    def fresh(text: str) -> bool:
        digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
        if digest in seen:
            skips["duplicate"] += 1
            return False
        seen.add(digest)
        return True

    for source, key, text in pydoc_topics():
        yield _row(text, f"pydoc-topics/{key}", source)
    work = [("stdlib", path, rel) for path, rel in stdlib_files()]
    if scope == "installed":
        work += [("site-packages", path, site) for site in site_package_dirs() for path in package_files(site)]
    for doc, file_skips in parse_files(work, workers, progress, desc=f"embedded corpus ({scope})"):
        skips.update(file_skips)
        if doc is not None and fresh(doc[2]):
            yield _row(doc[2], doc[1], doc[0])


def _row(text: str, key: str, source: str) -> dict:
    # A FineWeb-Edu-like educational score: longer pages read as more educational (1..5).
    score = min(5.0, 1.0 + math.log10(len(text)) - 2.0)
    return {
        "text": text,
        "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'embedded:' + key)}>",
        "dump": "embedded-package-docs" if key.startswith("site-packages/") else "embedded-python-docs",
        "url": f"python://{key}",
        "date": "2024-01-01T00:00:00Z",
        "file_path": f"embedded/{key}",
        "language": "en",
        "language_score": 1.0,
        "token_count": len(text.split()),  # whitespace words, not model tokens
        "score": round(score, 4),
        "int_score": int(round(score)),
        "dump_source": source,  # not written: the manifest's counts by source
    }


def corpus_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.parquet")):
        h.update(f.read_bytes())
    return h.hexdigest()
