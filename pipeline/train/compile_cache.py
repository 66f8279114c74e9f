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
The NSA layers' own Triton kernels are not in it (they are Triton's, launched from an opaque op, not inductor's):
nsa_model/precompile.py compiles those before the first step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch


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
    problems: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return graph_key(self.fields)

    @property
    def file(self) -> str:
        return self.folder.rstrip("/") + f"/{self.key}.bin"

    def load(self) -> None:
        """Writes the shared artifacts into this node's local caches. No file yet: nothing loaded. A file that
        cannot be read or loaded is reported (problems, the startup line) and the run compiles without it."""
        start = time.time()
        fs, folder = _filesystem(self.folder)
        path = f"{folder}/{self.key}.bin"
        try:
            if fs.get_file_info(path).type == pafs.FileType.NotFound:
                return
            with fs.open_input_stream(path) as f:
                blob = f.read()
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as e:  # a cache: the run goes on, compiling what it cannot load, and says so
            self._problem(f"could not load {self.file}: {type(e).__name__}: {e}")
            return
        finally:
            self.load_s = time.time() - start
        if info is None:  # torch logs why (a checksum, another torch's format) and returns nothing
            self._problem(f"could not load {self.file}: torch.compiler.load_cache_artifacts refused its "
                          f"{len(blob)} bytes")
            return
        self.loaded_bytes = len(blob)
        self.loaded = _artifact_keys(info)

    def save(self) -> None:
        """Writes the artifacts this process used, unless they are the ones it loaded. Local folders get the file
        by a rename, object stores by one put, so a reader never sees half a file."""
        try:
            result = torch.compiler.save_cache_artifacts()
            if result is None:
                return
            blob, info = result
            keys = _artifact_keys(info)
            if keys == self.loaded:
                return
            fs, folder = _filesystem(self.folder)
            fs.create_dir(folder, recursive=True)
            _write(fs, f"{folder}/{self.key}.bin", blob)
            _write(fs, f"{folder}/{self.key}.json",
                   json.dumps({"key_fields": self.fields, "artifacts": sorted(map(list, keys)), "bytes": len(blob),
                               "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1).encode())
        except Exception as e:  # the run's training is not at stake: report it and go on
            self._problem(f"could not save {self.file}: {type(e).__name__}: {e}")
            return
        self.saved = len(keys)

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        print(f"compile cache: {text}", flush=True)  # now, on the rank it happened on; the startup line repeats it

    def metrics(self) -> dict[str, float]:
        return {"startup_compile_cache_loaded": len(self.loaded), "startup_compile_cache_load_s": self.load_s,
                "startup_compile_cache_saved": self.saved, "startup_compile_cache_problems": len(self.problems)}

    def line(self) -> str:
        if self.loaded:
            text = (f"compile cache: {len(self.loaded)} artifacts ({self.loaded_bytes / 1e6:.1f} MB) loaded from "
                    f"{self.file}")
        else:
            text = f"compile cache: nothing to load at {self.file}"
        if self.saved:
            text += f", {self.saved} saved there"
        return "; ".join([text, *self.problems])


def _write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    if isinstance(fs, pafs.LocalFileSystem):
        temporary = f"{path}.{os.getpid()}.tmp"
        with fs.open_output_stream(temporary) as f:
            f.write(data)
        fs.move(temporary, path)
    else:
        with fs.open_output_stream(path) as f:
            f.write(data)
