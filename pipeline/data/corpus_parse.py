"""Parsing the embedded corpus's files into documents, in order, optionally in parallel processes.

Parallel parsing runs in a child interpreter (`python -m pipeline.data.corpus_parse WORK RESULTS N`) that owns
its process pool: the caller may be a script without a `__main__` guard (spawned pool workers would re-run
it) or hold threads (Ray; forking those is unsafe), and a crash while parsing cannot take the caller down.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from pipeline.data.corpus_sources import SkipCounter, module_page, package_document

# One unit of work: ("stdlib", path, relative path) or ("site-packages", path, site-packages folder).
WorkItem = tuple[str, Path, object]
Parsed = tuple[tuple[str, str, str] | None, SkipCounter]  # ((source, key, text) or None, skip reasons)


def parse_files(work: list[WorkItem], workers: int, progress: bool, desc: str) -> list[Parsed]:
    """file_document(item) for every item, in the order of `work`, whatever `workers`."""
    if workers <= 1:
        return [file_document(item) for item in tqdm(work, desc=desc, unit=" files", disable=not progress)]
    with tempfile.TemporaryDirectory(prefix="corpus-parse-") as tmp:
        work_path, results_path = Path(tmp) / "work.pkl", Path(tmp) / "results.pkl"
        work_path.write_bytes(pickle.dumps((work, desc, progress)))
        # The child imports this very package, wherever the caller found it (a checkout, not the installed one).
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-m", "pipeline.data.corpus_parse", str(work_path), str(results_path),
                        str(workers)], check=True, env=env)
        return pickle.loads(results_path.read_bytes())


def file_document(item: WorkItem) -> Parsed:
    kind, path, extra = item
    skips = SkipCounter()
    if kind == "stdlib":
        text = stdlib_page(path, extra, skips)
        return (None if text is None else ("stdlib", f"stdlib/{extra}", text)), skips
    doc = package_document(path, extra, skips)
    return (None if doc is None else (doc[0], f"site-packages/{doc[1]}", doc[2])), skips


def stdlib_page(path: Path, rel: str, skips: SkipCounter) -> str | None:
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        skips["unreadable"] += 1
        return None
    return module_page(source, rel.removesuffix(".py").replace("/", "."), skips)


def _main(work_path: str, results_path: str, workers: int) -> None:
    work, desc, progress = pickle.loads(Path(work_path).read_bytes())
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        results = list(tqdm(pool.map(file_document, work, chunksize=32), total=len(work), desc=desc,
                            unit=" files", disable=not progress))
    Path(results_path).write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
