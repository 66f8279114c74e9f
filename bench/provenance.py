"""The commit a benchmark result was measured at, for the GPU benches' result files."""

from __future__ import annotations

import subprocess


def git_commit() -> str:
    """Short HEAD, with "+uncommitted" when the tree has changes; "uncommitted" outside a git checkout (a copy of
    the tree on a GPU host: pass --commit there)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return commit + ("+uncommitted" if dirty else "")
    except Exception:
        return "uncommitted"
