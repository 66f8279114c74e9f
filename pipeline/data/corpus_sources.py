"""Where the embedded corpus's documents come from: text that ships with Python and its installed packages.

Every source yields (source_label, doc_key, text) in a fixed order, never importing the code it reads:
  pydoc-topics      the pydoc topic pages (pydoc_data.topics, plain data)
  stdlib            each pure-Python stdlib module's docstrings, read with `ast` from the source file
  package-docstring the same for every module of the installed packages (site-packages)
  package-doc       documentation files inside packages (.md, .rst, .txt), licence boilerplate excluded
  package-metadata  the long description (usually the README) in each installed distribution's METADATA
Files that cannot be read or parsed are skipped and counted by reason in a `SkipCounter`.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator

MIN_DOC_CHARS = 200  # shorter docstring pages are mostly signatures, not prose
MAX_FILE_BYTES = 2_000_000  # larger source or text files are generated code or data tables, not prose
DOC_SUFFIXES = (".md", ".rst", ".txt")
_SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__"}
# Files that are licences, notices or package bookkeeping, not documentation (matched on the lowercase name).
_LICENCE_NAME = re.compile(r"^(licen[cs]e|copying|notice|authors|contributors|copyright|patents|"
                           r"third[-_]?party[-_]?notices?|thirdpartynotices)")
_BOOKKEEPING_NAME = re.compile(r"^(requirements|constraints|top_level|entry_points|dependency_links|"
                               r"sources|namespace_packages|installed-files|not-zip-safe|vocab|merges|"
                               r"cmakelists)")
# Opening phrases of common licence texts: a document starting with one is boilerplate.
_LICENCE_TEXT = re.compile(r"(permission is hereby granted|licensed under the apache license|apache license\s*"
                           r"version 2|gnu (lesser |library |affero )?general public license|redistribution "
                           r"and use in source and binary forms|mozilla public license|this is free and "
                           r"unencumbered software|the mit license|bsd \d-clause license)", re.IGNORECASE)


class SkipCounter(Counter):
    """reason -> files skipped (unreadable, too large, not prose, licence, duplicate, ...)."""


def pydoc_topics() -> Iterator[tuple[str, str, str]]:
    from pydoc_data import topics
    for key, text in sorted(topics.topics.items()):
        if len(text) >= MIN_DOC_CHARS:
            yield "pydoc-topics", key, text


def stdlib_files() -> list[tuple[Path, str]]:
    """(path, relative posix path) of the stdlib's pure-Python modules, tests excluded, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in _SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        out.append((path, rel.as_posix()))
    return out


def site_package_dirs() -> list[Path]:
    """The interpreter's site-packages folders (purelib, platlib), existing, without repeats."""
    paths = sysconfig.get_paths()
    dirs = []
    for key in ("purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in dirs:
            dirs.append(p)
    return dirs


def package_files(site_dir: Path) -> list[Path]:
    """Files of one site-packages folder that may hold prose, sorted: modules, doc files, METADATA."""
    out = []
    for path in sorted(site_dir.rglob("*")):
        rel = path.relative_to(site_dir)
        if any(part in _SKIP_DIRS or part.startswith("test_") for part in rel.parts[:-1]):
            continue
        top = rel.parts[0]
        if top.endswith((".dist-info", ".egg-info")):
            if rel.name in ("METADATA", "PKG-INFO") and len(rel.parts) == 2:
                out.append(path)
            continue
        if path.suffix == ".py" and not rel.name.startswith("test_"):
            out.append(path)
        elif path.suffix.lower() in DOC_SUFFIXES:
            out.append(path)
    return [p for p in out if p.is_file()]


def package_document(path: Path, site_dir: Path, skips: SkipCounter) -> tuple[str, str, str] | None:
    """(source, key, text) for one file under site_dir, or None (the reason counted in skips)."""
    rel = path.relative_to(site_dir)
    name = rel.name.lower()
    if _LICENCE_NAME.match(name) or (rel.parts[0].endswith("-info") and "licen" in name):
        skips["licence_file"] += 1
        return None
    if path.suffix.lower() in DOC_SUFFIXES and _BOOKKEEPING_NAME.match(name):
        skips["bookkeeping_file"] += 1
        return None
    raw = _read_text(path, skips)
    if raw is None:
        return None
    if path.suffix == ".py":
        text = module_page(raw, ".".join(rel.with_suffix("").parts), skips)
        source = "package-docstring"
    elif rel.parts[0].endswith("-info"):
        text = metadata_description(raw)
        source = "package-metadata"
    else:
        text = raw if looks_like_prose(raw) else None
        if text is None:
            skips["not_prose"] += 1
        source = "package-doc"
    if text is None or len(text) < MIN_DOC_CHARS:
        return None
    if _LICENCE_TEXT.search(text[:2000]) and source != "package-docstring":
        skips["licence_text"] += 1
        return None
    return source, rel.as_posix(), text


def _read_text(path: Path, skips: SkipCounter) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            skips["too_large"] += 1
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        skips["unreadable"] += 1
        return None


def module_page(source: str, module: str, skips: SkipCounter | None = None) -> str | None:
    """A module's docstrings as one document: its own, then each class and function's (source never run)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        if skips is not None:
            skips["unparsable"] += 1
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


def metadata_description(metadata: str) -> str | None:
    """The long description of a METADATA / PKG-INFO file: the body after the headers, or its
    Description header (older metadata, continuation lines indented by 8 spaces or '|')."""
    head, sep, body = metadata.partition("\n\n")
    if sep and body.strip():
        return body.strip()
    match = re.search(r"^Description: (.*(?:\n(?: {8}|\|).*)*)", head, re.MULTILINE)
    if not match:
        return None
    lines = match.group(1).split("\n")
    return "\n".join([lines[0]] + [re.sub(r"^( {8}|\|)", "", ln) for ln in lines[1:]]).strip()


def looks_like_prose(text: str) -> bool:
    """Sentences rather than data: mostly letters and spaces, and most non-empty lines hold several words
    (word lists, vocabularies, requirement pins and tables of numbers fail)."""
    sample = text[:20_000]
    if not sample.strip():
        return False
    letters = sum(c.isalpha() or c.isspace() for c in sample) / len(sample)
    lines = [ln for ln in sample.splitlines() if ln.strip()]
    wordy = sum(len(ln.split()) >= 4 for ln in lines) / len(lines)
    return letters >= 0.75 and wordy >= 0.4
