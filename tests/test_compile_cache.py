"""The shared compile cache (pipeline/train/compile_cache.py): torch.compile's artifacts saved by one process are
found by another whose local caches are empty, as on a node that never compiled the model."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nsa_model import Transformer
from pipeline.config import load_job_config, resolve_paths
from pipeline.train.compile_cache import SharedCompileCache, cache_folder, graph_fields, graph_key

ROOT = Path(__file__).resolve().parent.parent

# One process's compiled step: a small model's forward and backward, then the shared cache's load or save and
# what inductor's and AOT autograd's caches counted.
STEP = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from pipeline.train.compile_cache import SharedCompileCache

    action, folder = sys.argv[1], sys.argv[2]
    cache = SharedCompileCache(folder, {"test": "mlp"})
    if action == "load":
        cache.load()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    torch.compile(net)(x).square().sum().backward()
    cache.save()
    print(json.dumps({"loaded": len(cache.loaded), "saved": cache.saved, "problems": cache.problems,
                      "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                      "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                      "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}))
""")


def _step(tmp_path: Path, action: str, folder: Path, local_cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / local_cache), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", STEP, action, str(folder)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_artifacts_saved_by_one_process_are_found_by_another_with_empty_caches(tmp_path):
    """The first process compiles everything (misses) and saves; a second one, on empty local caches, loads the
    file and compiles nothing: every graph is a hit. It saves nothing back, having used what it loaded."""
    folder = tmp_path / "shared"
    first = _step(tmp_path, "save", folder, "node-a")
    assert first["fx_miss"] >= 2 and first["fx_hit"] == 0 and first["saved"] >= 3, first  # forward, backward, AOT
    key = graph_key({"test": "mlp"})
    described = json.loads((folder / f"{key}.json").read_text())
    assert described["key_fields"] == {"test": "mlp"} and len(described["artifacts"]) == first["saved"]
    assert not list(folder.glob("*.tmp"))  # written by a rename

    second = _step(tmp_path, "load", folder, "node-b")
    assert second["loaded"] == first["saved"] and second["problems"] == [], second
    assert second["fx_hit"] == first["fx_miss"] and second["fx_miss"] == 0 and second["aot_hit"] >= 1, second
    assert second["saved"] == 0, second


def test_an_unreadable_file_is_reported_and_the_run_goes_on(tmp_path, capsys):
    cache = SharedCompileCache(str(tmp_path), {"test": "broken"})
    (tmp_path / f"{cache.key}.bin").write_bytes(b"not a cache")
    cache.load()
    assert cache.loaded == frozenset() and len(cache.problems) == 1
    assert f"could not load {cache.file}" in cache.problems[0] and cache.problems[0] in cache.line()
    assert "compile cache: could not load" in capsys.readouterr().out  # said at once, on the rank it happened on
    assert cache.metrics()["startup_compile_cache_problems"] == 1


def test_no_file_yet_loads_nothing(tmp_path):
    cache = SharedCompileCache(str(tmp_path / "absent"), {"test": "none"})
    cache.load()
    assert cache.loaded == frozenset() and cache.problems == []
    assert cache.line() == f"compile cache: nothing to load at {cache.file}"


def _job(*overrides):
    return load_job_config(None, list(overrides))


def test_the_cache_folder_follows_the_config(tmp_path):
    assert cache_folder(_job().train) is None  # the tiny job does not compile
    job = _job("train.compile=true", f"train.storage_path={tmp_path}")
    assert cache_folder(job.train) == f"{tmp_path}/compile_cache"
    assert cache_folder(_job("train.compile=true", "train.compile_cache=false").train) is None
    assert cache_folder(_job("train.compile=true", "train.compile_cache_path=s3://bucket/cc").train) == "s3://bucket/cc"
    resolved = resolve_paths(_job("train.compile=true", "train.compile_cache_path=rel/cc"))
    assert resolved.train.compile_cache_path == str(Path("rel/cc").resolve())
    with pytest.raises(ValueError, match="train.compile_cache_path: must be a non-empty path or URI"):
        _job("train.compile_cache_path=")


@pytest.mark.parametrize("backend, shared_across_n", [("torch", False), ("triton", True)])
def test_the_key_leaves_out_l_and_n_only_where_they_are_traced_symbolic(backend, shared_across_n, monkeypatch):
    """compile_model makes l' and n symbolic where every NSA module runs the Triton core (one graph for a sweep's
    settings): there two settings share a key; on the torch backend they are in the graph and must not."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton core resolves on CPU (nothing runs here)
    keys = []
    for n in (4, 5):
        job = _job("model.preset=tiny", f"model.nsa.n_selected={n}")
        model = Transformer(job.model, backend=backend)
        fields = graph_fields(job, model, torch.device("cpu"))
        assert fields["torch"] == torch.__version__ and fields["seq_len"] == job.data.seq_len
        keys.append(graph_key(fields))
    assert (keys[0] == keys[1]) == shared_across_n
    other_batch = _job("model.preset=tiny", "train.micro_batch=2", "train.global_batch=8")
    assert graph_key(graph_fields(other_batch, Transformer(other_batch.model), torch.device("cpu"))) not in keys



def test_a_save_that_cannot_write_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """The folder is a file here, so the save cannot write: said at once and in the startup line, nothing counted
    as saved, nothing raised into the training loop."""
    class Info:
        artifacts = {"inductor": ["graph"], "aot_autograd": ["joint"]}

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", Info()))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    cache = SharedCompileCache(str(blocked), {"test": "blocked"})
    cache.save()
    assert cache.saved == 0 and len(cache.problems) == 1 and f"could not save {cache.file}" in cache.problems[0]
    assert "compile cache: could not save" in capsys.readouterr().out
    writable = SharedCompileCache(str(tmp_path / "shared"), {"test": "blocked"})
    writable.save()  # the same artifacts where the folder can be made: written, two artifacts counted
    assert writable.saved == 2 and (tmp_path / "shared" / f"{writable.key}.bin").read_bytes() == b"artifacts"


def test_an_object_store_gets_the_file_in_one_put_and_gives_it_back(monkeypatch):
    """The s3:// / gs:// branch, on pyarrow's in-memory stand-in for a remote filesystem: the save puts the file
    and the json beside it through the filesystem's streams, and a load reads the same bytes back."""
    import pyarrow.fs as pafs

    from pipeline.train import compile_cache

    store, _ = pafs.FileSystem.from_uri("mock:///bucket")  # one instance: each from_uri makes an empty one
    monkeypatch.setattr(compile_cache, "_filesystem", lambda folder: (store, "bucket/compile_cache"))

    class Info:
        artifacts = {"inductor": ["graph"]}

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", Info()))
    given = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: given.append(blob) or Info())
    writer = SharedCompileCache("s3://bucket/compile_cache", {"test": "remote"})
    writer.save()
    names = sorted(i.base_name for i in store.get_file_info(pafs.FileSelector("bucket/compile_cache")))
    assert names == [f"{writer.key}.bin", f"{writer.key}.json"] and writer.saved == 1
    reader = SharedCompileCache("s3://bucket/compile_cache", {"test": "remote"})
    reader.load()
    assert given == [b"artifacts"] and reader.loaded == {("inductor", "graph")} and reader.problems == []
    assert reader.file == f"s3://bucket/compile_cache/{reader.key}.bin"
