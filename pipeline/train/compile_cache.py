"""torch.compile's artifacts shared through storage, so that a node which never compiled the model starts warm.

A compiled step's first run traces the model, generates inductor's code and compiles its Triton kernels: on a GPU
node whose local caches are cold that is most of a run's 40-70 s first step, against about 10 s where an earlier
run on the node left its caches (bench/results/kernels-notes.md v73-v77). Nodes an autoscaler adds, and the
cluster a KubeRay RayJob makes for each job, always start cold. torch's portable cache
(torch.compiler.save_cache_artifacts / load_cache_artifacts: inductor's generated code with its Triton kernels,
AOT autograd's graphs, dynamo's shape profile) carries those caches from one node to the next through storage
every node reads, by default <train.storage_path>/compile_cache:

- before the first compiled step every worker loads <folder>/<key>.bin where it exists, which writes the
  artifacts into its node's local caches; the compilation then finds them there;
- after the startup's two steps, rank 0 saves the artifacts its process used (compiled, or found in a cache) where
  they differ from those it loaded, with <key>.json beside them saying what the key was made of.

<key> digests what shapes the compiled graphs (graph_fields): torch and Triton versions, the GPU, the model
config, the micro-batch's shape, precision, compile mode and parallelism. It only keeps runs that cannot share
graphs from overwriting each other's file. Whether an artifact is used is inductor's decision, by its own keys
over the code and the graph, so a file that does not fit a run (a field the key leaves out, an edited kernel)
costs only misses: the run compiles as it would without it and then saves its own artifacts in its place.
The NSA layers' own Triton kernels are not in torch's artifacts (they are Triton's, launched from an opaque op, not
inductor's): nsa_model/precompile.py compiles them before the first step, about 5 s on a cold node against under 1 s
where Triton's cache folder holds them (kernels-notes.md v77, v78). So the entries of Triton's cache folder this
process used between load() and stop_recording() (in the training loop: the NSA kernels' precompile, their launchers
included) travel beside them, with those loaded, <folder>/<key>.triton.zip (a sweep's settings compile different
NSA kernels, so the file gathers them): each entry is one folder of
triton.knobs.cache.dir named by Triton's own hash of what it holds (a kernel compiled for one GPU by one Triton, or
a launcher's C module), so an entry another node cannot use is never looked up there. Triton's cache manager
(triton.knobs.cache.manager_class) is where the entries are noted: a Triton file cache that records the folders
it opens. The window ends before the first step because inductor compiles a kernel or two in the process itself,
under a key that changes from run to run (v78: a log-softmax reduction, a miss on every node): noted, each run
would add it to the file. A manager the user set (TRITON_CACHE_MANAGER, a remote cache) is left alone, and then only
torch's artifacts are shared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import platform
import re
import threading
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch

# Triton is imported where it is used, not here: the interpreter tests need Triton's first import to happen with
# TRITON_INTERPRET=1 (its own @jit helpers take their kind then), and the training loop imports this module.


def cache_folder(train) -> str | None:
    """Where a run's shared compile cache lives (train.compile_cache_path, else <storage_path>/compile_cache), or
    None where the run does not compile or does not share."""
    if not (train.compile and train.compile_cache):
        return None
    return train.compile_cache_path or train.storage_path.rstrip("/") + "/compile_cache"


def graph_fields(job, model: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    """What the compiled graphs of this run's training step depend on, beside the code. l' and n are left out
    where nsa_model.compile_model traces them as symbolic ints (one graph for every setting of a sweep)."""
    from nsa_model.model import swept_settings_symbolic

    t = job.train
    model_config = dataclasses.asdict(job.model)
    if swept_settings_symbolic(model):
        for name in ("sel_block", "n_selected"):
            model_config["nsa"].pop(name)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_name = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    else:
        device_name = f"{device.type} ({platform.machine()})"
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "device": device_name, "model": model_config,
            "seq_len": job.data.seq_len, "micro_batch": t.micro_batch, "precision": t.precision,
            "compile_mode": t.compile_mode, "parallelism": t.parallelism, "num_workers": t.num_workers,
            "activation_checkpointing": t.activation_checkpointing, "attention_recompute": t.attention_recompute}


def graph_key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def _filesystem(folder: str) -> tuple[pafs.FileSystem, str]:
    if "://" in folder:
        return pafs.FileSystem.from_uri(folder)
    return pafs.LocalFileSystem(), os.path.abspath(folder)


def _artifact_keys(info) -> frozenset[tuple[str, str]]:
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


@dataclass
class SharedCompileCache:
    """One run's use of the shared cache: load() before the first compiled step, save() on rank 0 after the
    steps that compiled. Both report what they did in metrics() and line() (the startup report)."""

    folder: str
    fields: dict[str, Any]
    loaded: frozenset[tuple[str, str]] = frozenset()
    load_s: float = 0.0
    loaded_bytes: int = 0
    saved: int = 0
    triton_loaded: frozenset[str] = frozenset()  # Triton cache entries written from the shared file
    triton_loaded_bytes: int = 0
    triton_dir: str = ""  # where they were written (Triton's cache folder then)
    triton_saved: int = 0
    triton_noted: bool = False  # whether this process noted the Triton cache entries it used (start_recording)
    triton_note: str = ""  # why it did not, for the startup line
    problems: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return graph_key(self.fields)

    @property
    def file(self) -> str:
        return self._path(".bin")

    def load(self) -> None:
        """Writes the shared artifacts into this node's local caches, torch's and Triton's, and starts noting the
        Triton cache entries this process uses (until stop_recording(); for save()). No file yet: nothing loaded.
        A file that cannot be read or loaded is reported (problems, the startup line) and the run compiles without
        it."""
        start = time.time()
        try:
            blob = self._read(".bin")
            if blob is not None:
                info = torch.compiler.load_cache_artifacts(blob)
                if info is None:  # torch logs why (a checksum, another torch's format) and returns nothing
                    self._problem(f"could not load {self.file}: torch.compiler.load_cache_artifacts refused its "
                                  f"{len(blob)} bytes")
                else:
                    self.loaded_bytes = len(blob)
                    self.loaded = _artifact_keys(info)
        except Exception as e:  # a cache: the run goes on, compiling what it cannot load, and says so
            self._problem(f"could not load {self.file}: {type(e).__name__}: {e}")
        try:
            blob = self._read(TRITON_SUFFIX)
            if blob is not None:
                import triton

                self.triton_dir = triton.knobs.cache.dir
                self.triton_loaded = unpack_triton_entries(blob, self.triton_dir)
                self.triton_loaded_bytes = len(blob)
        except Exception as e:
            self._problem(f"could not load {self._path(TRITON_SUFFIX)}: {type(e).__name__}: {e}")
        self.start_recording()
        self.load_s = time.time() - start

    def start_recording(self) -> None:
        """Notes from now on the Triton cache entries this process uses (load() does it after loading)."""
        self.triton_noted = start_noting_triton_entries()
        if not self.triton_noted:  # a choice of the user's, not a problem: said in the startup line
            self.triton_note = ("Triton's cache manager is the user's own (triton.knobs.cache.manager_class, "
                                "TRITON_CACHE_MANAGER), so Triton's cache entries are not shared")

    def stop_recording(self) -> None:
        """Triton's own file cache again; save() writes what was noted until now."""
        stop_noting_triton_entries()

    def save(self) -> None:
        """Writes the artifacts this process used, unless they are the ones it loaded, and likewise the Triton
        cache entries it noted (with those it loaded, where it used others). Local folders get each file by a
        rename, object stores by one put, so a reader never sees half a file."""
        try:
            self._save_torch()
        except Exception as e:  # the run's training is not at stake: report it and go on
            self._problem(f"could not save {self.file}: {type(e).__name__}: {e}")
        try:
            self._save_triton()
        except Exception as e:
            self._problem(f"could not save {self._path(TRITON_SUFFIX)}: {type(e).__name__}: {e}")

    def _save_torch(self) -> None:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return
        blob, info = result
        keys = _artifact_keys(info)
        if keys == self.loaded:
            return
        fs, folder = self._filesystem()
        _write(fs, f"{folder}/{self.key}.bin", blob)
        _write(fs, f"{folder}/{self.key}.json",
               json.dumps({"key_fields": self.fields, "artifacts": sorted(map(list, keys)), "bytes": len(blob),
                           "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1).encode())
        self.saved = len(keys)

    def _save_triton(self) -> None:
        self.stop_recording()
        if not self.triton_noted:
            return
        used = noted_triton_folders()
        if {os.path.basename(f) for f in used} <= self.triton_loaded:  # nothing used that the file lacks
            return
        # with what was loaded: a sweep's settings compile different NSA kernels, and each run keeps the others'
        # (one folder an entry: the name is Triton's hash, wherever the folder is)
        folders = {entry: os.path.join(self.triton_dir, entry) for entry in self.triton_loaded}
        folders = {entry: f for entry, f in folders.items() if _entry_files(f)}
        folders.update({os.path.basename(f): f for f in used})
        blob = pack_triton_entries(set(folders.values()))
        fs, folder = self._filesystem()
        _write(fs, f"{folder}/{self.key}{TRITON_SUFFIX}", blob)
        self.triton_saved = len(folders)

    def _path(self, suffix: str) -> str:
        return self.folder.rstrip("/") + f"/{self.key}{suffix}"

    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        fs, folder = _filesystem(self.folder)
        fs.create_dir(folder, recursive=True)
        return fs, folder

    def _read(self, suffix: str) -> bytes | None:
        fs, folder = _filesystem(self.folder)
        path = f"{folder}/{self.key}{suffix}"
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return None
        with fs.open_input_stream(path) as f:
            return f.read()

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        print(f"compile cache: {text}", flush=True)  # now, on the rank it happened on; the startup line repeats it

    def metrics(self) -> dict[str, float]:
        return {"startup_compile_cache_loaded": len(self.loaded), "startup_compile_cache_load_s": self.load_s,
                "startup_compile_cache_saved": self.saved, "startup_compile_cache_problems": len(self.problems),
                "startup_compile_cache_triton_loaded": len(self.triton_loaded),
                "startup_compile_cache_triton_saved": self.triton_saved}

    def line(self) -> str:
        loaded = [f"{n} {what} ({size / 1e6:.1f} MB) from {path}" for n, what, size, path in (
            (len(self.loaded), "artifacts", self.loaded_bytes, self.file),
            (len(self.triton_loaded), "Triton cache entries", self.triton_loaded_bytes, self._path(TRITON_SUFFIX)))
            if n]
        text = (f"compile cache: loaded {' and '.join(loaded)}" if loaded
                else f"compile cache: nothing to load at {self.file}")
        saved = [f"{n} {what}" for n, what in ((self.saved, "artifacts"), (self.triton_saved, "Triton cache entries"))
                 if n]
        if saved:
            text += f"; saved {' and '.join(saved)} there"
        return "; ".join([text, *([self.triton_note] if self.triton_note else []), *self.problems])


# --- Triton's cache entries ------------------------------------------------------------------------------------

TRITON_SUFFIX = ".triton.zip"
_ENTRY = re.compile(r"^[A-Za-z0-9_-]+$")  # Triton names an entry's folder by a base32 hash
_GROUP_PREFIX = "__grp__"  # a kernel's group file: its files' absolute paths, which differ from node to node


_noted: set[str] = set()  # the folders of the Triton cache entries noted (_noting_manager)
_noted_lock = threading.Lock()  # compile_nsa_kernels compiles on several threads at once
_manager_class = None


def _noting_manager():
    """Triton's own file cache (one folder an entry under triton.knobs.cache.dir), noting each entry this process
    opens to read or write while it is triton.knobs.cache.manager_class: the NSA kernels compiled or found, their
    launchers' C modules, and any other kernel compiled in this process meanwhile. Made at its first use (above)."""
    global _manager_class
    if _manager_class is None:
        from triton.runtime.cache import FileCacheManager

        class NotingFileCacheManager(FileCacheManager):
            def __init__(self, key, override=False, dump=False):
                super().__init__(key, override=override, dump=dump)
                if not (override or dump):
                    with _noted_lock:
                        _noted.add(self.cache_dir)

        _manager_class = NotingFileCacheManager
    return _manager_class


def start_noting_triton_entries() -> bool:
    """Makes the noting file cache Triton's cache manager, unless one is set already (the user's: then False)."""
    import triton

    current, noting = triton.knobs.cache.manager_class, _noting_manager()
    if current is not None and current is not noting:
        return False
    with _noted_lock:
        _noted.clear()
    triton.knobs.cache.manager_class = noting
    return True


def stop_noting_triton_entries() -> None:
    """Triton's default manager again (or TRITON_CACHE_MANAGER's); what was noted stays for noted_triton_folders()."""
    import triton

    if _manager_class is not None and triton.knobs.cache.manager_class is _manager_class:
        del triton.knobs.cache.manager_class


def noted_triton_folders() -> set[str]:
    """The noted entries' folders that hold files (a lookup that missed leaves an empty one)."""
    with _noted_lock:
        noted = set(_noted)
    return {folder for folder in noted if _entry_files(folder)}


def _entry_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))


def pack_triton_entries(folders: set[str]) -> bytes:
    """A zip of the entries' files, <entry>/<file> (entry: the folder's name, Triton's hash)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for folder in sorted(folders):
            for name in _entry_files(folder):
                archive.write(os.path.join(folder, name), f"{os.path.basename(folder)}/{name}")
    return buffer.getvalue()


def unpack_triton_entries(blob: bytes, cache_dir: str) -> frozenset[str]:
    """Writes the zip's entries into cache_dir, as Triton's file cache would have: each file by a rename (another
    worker of the node may be reading or writing the same entry), files already there left as they are, and each
    group file's paths pointed at this node's folder. Refuses a member that is not <entry>/<file>."""
    entries = set()
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        for member in archive.infolist():
            parts = member.filename.split("/")
            if len(parts) != 2 or not _ENTRY.match(parts[0]) or parts[1] in ("", ".", ".."):
                raise ValueError(f"{member.filename!r} is not <entry>/<file> of Triton's cache")
            entry, name = parts
            folder = os.path.join(cache_dir, entry)
            entries.add(entry)
            target = os.path.join(folder, name)
            if os.path.exists(target):
                continue
            data = archive.read(member)
            if name.startswith(_GROUP_PREFIX):
                group = json.loads(data)
                group["child_paths"] = {child: os.path.join(folder, os.path.basename(path))
                                        for child, path in group["child_paths"].items()}
                data = json.dumps(group).encode()
            os.makedirs(folder, exist_ok=True)
            temporary = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, target)
    return frozenset(entries)


def _write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    if isinstance(fs, pafs.LocalFileSystem):
        temporary = f"{path}.{os.getpid()}.tmp"
        with fs.open_output_stream(temporary) as f:
            f.write(data)
        fs.move(temporary, path)
    else:
        with fs.open_output_stream(path) as f:
            f.write(data)
