"""The embedded corpus: real English text that ships with Python, as FineWeb-Edu-schema Parquet.

No network: documents are the pydoc topic pages (pydoc_data.topics) and, for every pure-Python
stdlib module, its docstrings (module, classes, functions) read with `ast` from the source files,
never imported. Built deterministically (sorted files, fixed ids) under <output_dir>/corpus/ on
first use and reused after; the folder appears atomically, so concurrent first uses are safe.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

CORPUS_VERSION = 1
NUM_FILES = 4
MIN_DOC_CHARS = 200  # shorter docstring pages are mostly signatures, not prose

# FineWeb-Edu's columns and types.
SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
    ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
    ("int_score", pa.int64()),
])
_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__"}


def corpus_dir(output_dir: str) -> Path:
    return Path(output_dir).resolve() / "corpus"


def ensure_corpus(output_dir: str) -> Path:
    """The embedded corpus folder (Parquet files), built on first use."""
    target = corpus_dir(output_dir)
    if (target / "manifest.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".corpus-", dir=target.parent))
    try:
        _write_corpus(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)  # atomic; fails if another process won the race
        except OSError:
            if not (target / "manifest.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_corpus(folder: Path) -> None:
    docs = list(_documents())
    per_file = math.ceil(len(docs) / NUM_FILES)
    for i in range(NUM_FILES):
        part = docs[i * per_file:(i + 1) * per_file]
        columns = {name: [d[name] for d in part] for name in SCHEMA.names}
        pq.write_table(pa.table(columns, schema=SCHEMA), folder / f"part-{i:03d}.parquet")
    manifest = {"version": CORPUS_VERSION, "documents": len(docs), "files": NUM_FILES,
                "chars": sum(len(d["text"]) for d in docs), "python": sys.version.split()[0]}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _documents():
    """Every document as a FineWeb-Edu row, in a fixed order."""
    for key, text in sorted(_pydoc_topics().items()):
        yield _row(text, f"pydoc-topics/{key}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in _SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        text = _module_page(path, ".".join(rel.with_suffix("").parts))
        if text is not None:
            yield _row(text, f"stdlib/{rel.as_posix()}")


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data import topics
    return {k: v for k, v in topics.topics.items() if len(v) >= MIN_DOC_CHARS}


def _module_page(path: Path, module: str) -> str | None:
    """A module's docstrings as one document: its own, then each class and function's."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"{module}\n\n{doc}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                parts.append(f"{node.name}\n\n{doc}")
    text = "\n\n".join(parts)
    return text if len(text) >= MIN_DOC_CHARS else None


def _row(text: str, source: str) -> dict:
    # A FineWeb-Edu-like educational score: longer pages read as more educational (1..5).
    score = min(5.0, 1.0 + math.log10(len(text)) - 2.0)
    return {
        "text": text,
        "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'embedded:' + source)}>",
        "dump": "embedded-python-docs",
        "url": f"python://{source}",
        "date": "2024-01-01T00:00:00Z",
        "file_path": f"embedded/{source}",
        "language": "en",
        "language_score": 1.0,
        "token_count": len(text.split()),  # whitespace words, not model tokens
        "score": round(score, 4),
        "int_score": int(round(score)),
    }


def corpus_sha256(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.parquet")):
        h.update(f.read_bytes())
    return h.hexdigest()
