"""The commit a benchmark result was measured at, for the GPU benches' result files."""

from __future__ import annotations

import argparse
import re
import subprocess

# What a result file's name may hold beyond its fixed parts: the device tool returns files from a GPU host only if
# their names are letters, digits, '.', '_' and '-' (a tag with a comma cost two training results, kernels-notes v35)
FILE_SUFFIX = re.compile(r"[A-Za-z0-9._-]*")


def file_suffix(text: str) -> str:
    """argparse type of a result file's suffix or tag: refused before anything runs unless FILE_SUFFIX matches."""
    if not FILE_SUFFIX.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: a result file's suffix may hold only letters, digits, '.', '_' "
                                         "and '-' (files named otherwise do not come back from the GPU host)")
    return text


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


def code_fingerprint(package=None) -> str:
    """"<hash> at <folder>": a short sha256 of the .py sources of the nsa_model package this process imported, and
    where it lies. A result file carries it beside the commit, so an A/B of two trees in one call shows which code
    each side ran: a bench that puts its own checkout first on sys.path runs that checkout's nsa_model whatever
    PYTHONPATH says: kernels-notes v43 found that v42's A/B (and, made the same way, v41's model-step one) had timed
    one tree against itself."""
    import hashlib
    import pathlib

    if package is None:
        import nsa_model as package
    root = pathlib.Path(package.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{digest.hexdigest()[:12]} at {root}"


def result_stem(out_dir, prefix: str, suffix: str, commit: str):
    """(stem, meta) of a result file: out_dir/<prefix>-<device tag>-<date><suffix> (add .json or .md) and what
    it was measured on: device (the GPU's name, or "cpu" without CUDA), UTC date, commit, torch and triton
    versions, and the nsa_model sources it ran (code_fingerprint)."""
    import datetime
    import pathlib

    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tag = "h200" if "H200" in device else "h100" if "H100" in device else device.split()[-1].lower()
    stamp = datetime.datetime.now(datetime.timezone.utc)
    meta = {"device": device, "date": f"{stamp:%Y-%m-%d %H:%M} UTC", "commit": commit, "torch": torch.__version__,
            "triton": triton.__version__, "nsa_model": code_fingerprint()}
    return pathlib.Path(out_dir) / f"{prefix}-{tag}-{stamp:%Y-%m-%d}{suffix}", meta


def result_file(stem, ext: str):
    """stem (a result_stem path) + ext (".json", ".md"). Not Path.with_suffix: a suffix may hold a dot ("-v45a.2"),
    which with_suffix takes for the file's extension and replaces, so two runs' files would land on one name."""
    return stem.with_name(stem.name + ext)
