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


# One process's Triton work, as a GPU worker's startup does it: the shared cache loaded (which starts noting Triton's
# cache entries), a kernel compiled for an H100 (a stand-in driver: no GPU here) and a launcher-like C module
# built through Triton's builder (what Triton does for each kernel signature), the noting stopped (the loop: after
# its precompile), one more kernel compiled, then the save. With "no-build" or
# "other", building C fails, so the module must come from Triton's cache; "other" compiles the kernel at another
# constexpr (as a sweep's next setting compiles the NSA kernels at its l' and n).
TRITON_STEP = textwrap.dedent("""
    import json, sys
    import torch
    import triton
    import triton.language as tl
    import triton.runtime.build as build
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from pipeline.train.compile_cache import SharedCompileCache


    class CompileOnlyDriver:  # an H100 for the compiler
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0


    driver.set_active(CompileOnlyDriver())
    action, folder = sys.argv[1], sys.argv[2]
    if action in ("no-build", "other"):
        def refuse(*args, **kwargs):
            raise RuntimeError("built C instead of reading Triton's cache")
        build._build = refuse
    heard = []
    triton.knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: heard.append(
        [src.fn.__name__, cache_hit, sorted(metadata_group.values())])


    @triton.jit
    def scale_rows(X, Y, s, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(Y + offs, tl.load(X + offs) * s)


    MODULE_C = (  # the least Python extension: Triton's launchers are such modules, one per kernel signature
        "#include <Python.h>\\n"
        "static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, \\"nsa_cache_probe\\", NULL, -1, NULL};\\n"
        "PyMODINIT_FUNC PyInit_nsa_cache_probe(void) { return PyModule_Create(&probe); }\\n")
    cache = SharedCompileCache(folder, {"test": "triton"})
    cache.load()
    scale_rows.warmup(torch.float32, torch.float32, 2.0, N=32 if action == "other" else 64, grid=(1,))
    module = build.compile_module_from_src(MODULE_C, "nsa_cache_probe")
    cache.stop_recording()  # as the loop does after its precompile: what compiles later is not shared
    scale_rows.warmup(torch.float32, torch.float32, 2.0, N=16, grid=(1,))
    cache.save()
    print(json.dumps({"triton_loaded": len(cache.triton_loaded), "triton_saved": cache.triton_saved,
                      "problems": cache.problems, "heard": heard, "module": module.__file__,
                      "manager_after": str(triton.knobs.cache.manager_class)}))
""")


def _triton_step(tmp_path: Path, action: str, folder: Path, local_cache: str) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(tmp_path / local_cache)}
    script = tmp_path / "triton_step.py"  # a file: Triton reads a kernel's source from it
    script.write_text(TRITON_STEP)
    out = subprocess.run([sys.executable, str(script), action, str(folder)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_triton_cache_entries_saved_by_one_process_are_found_by_another_with_an_empty_cache(tmp_path):
    """The NSA kernels are Triton's, outside torch's artifacts: the entries of Triton's cache folder a process used
    while it noted them (a kernel compiled for the GPU, a C module built; not the kernel compiled after) travel in
    <key>.triton.zip. A second process on an empty
    Triton cache folder finds the kernel there (the listener says cache hit; its files are in its own folder, the
    group file pointed there) and the module without building C, and saves nothing back. A third that compiles
    the kernel at another constexpr saves it together with what it loaded."""
    folder = tmp_path / "shared"
    first = _triton_step(tmp_path, "save", folder, "node-a")
    assert first["problems"] == [] and first["triton_loaded"] == 0, first
    assert [(name, hit) for name, hit, _ in first["heard"]] == [("scale_rows", False)] * 2
    assert first["triton_saved"] == 2, first  # the kernel's entry and the module's, not the kernel after the window
    assert first["manager_after"] == "None"  # Triton's own file cache again after the save
    key = graph_key({"test": "triton"})
    assert (folder / f"{key}.triton.zip").is_file() and not list(folder.glob("*.tmp"))

    second = _triton_step(tmp_path, "no-build", folder, "node-b")
    assert second["problems"] == [] and second["triton_loaded"] == 2, second
    [(name, hit, paths), (_, later_hit, _)] = second["heard"]
    assert (name, hit, later_hit) == ("scale_rows", True, False)  # the kernel after the window was not shared
    assert paths and all(p.startswith(str(tmp_path / "node-b")) for p in paths), paths
    assert second["module"].startswith(str(tmp_path / "node-b"))
    assert second["triton_saved"] == 0, second

    # another setting on a third node: its kernel compiles, and the file then holds it beside the two it loaded
    third = _triton_step(tmp_path, "other", folder, "node-c")
    assert [(name, hit) for name, hit, _ in third["heard"]] == [("scale_rows", False)] * 2, third
    assert third["triton_loaded"] == 2 and third["triton_saved"] == 3 and third["problems"] == [], third


def test_a_bad_triton_file_is_reported_and_the_run_goes_on(tmp_path):
    """A member outside <entry>/<file> (here a path that climbs out of the cache folder) is refused by name; an
    unreadable zip likewise; torch's part is unaffected."""
    import io
    import zipfile

    from pipeline.train.compile_cache import stop_noting_triton_entries, unpack_triton_entries

    for bad in ("ENTRY/../../escape.so", "ENTRY/.."):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr(bad, b"x")
        with pytest.raises(ValueError, match=f"'{bad}' is not <entry>/<file> of Triton's cache"):
            unpack_triton_entries(buffer.getvalue(), str(tmp_path / "triton"))
    assert not (tmp_path / "escape.so").exists()
    cache = SharedCompileCache(str(tmp_path / "shared"), {"test": "bad zip"})
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / f"{cache.key}.triton.zip").write_bytes(b"not a zip")
    try:
        cache.load()
    finally:
        stop_noting_triton_entries()
    assert len(cache.problems) == 1 and "could not load" in cache.problems[0] and ".triton.zip" in cache.problems[0]
    assert cache.triton_loaded == frozenset() and cache.problems[0] in cache.line()


def test_the_training_side_leaves_triton_unimported():
    """Triton's first import must happen with TRITON_INTERPRET=1 for the interpreter tests (its own @jit helpers
    take their kind then), and test modules import the training loop and this cache first: neither may import
    Triton on import (a top-level import here failed 168 interpreter tests in one CI run)."""
    code = ("import sys, pipeline.train.compile_cache, pipeline.train.loop, pipeline.train.trainer, pipeline.tune; "
            "print('triton' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_a_triton_cache_manager_of_the_users_own_is_left_in_place(tmp_path):
    """Where the user set Triton's cache manager (a remote cache, say), the run leaves it in place, shares only torch's
    artifacts and says so in its startup line, without counting it as a problem."""
    import triton
    from triton.runtime.cache import FileCacheManager

    class Mine(FileCacheManager):
        pass

    triton.knobs.cache.manager_class = Mine
    try:
        cache = SharedCompileCache(str(tmp_path), {"test": "own manager"})
        cache.load()
        assert triton.knobs.cache.manager_class is Mine and not cache.triton_noted
        cache.save()
        assert triton.knobs.cache.manager_class is Mine
    finally:
        del triton.knobs.cache.manager_class
    assert cache.problems == [] and cache.triton_saved == 0
    assert "Triton's cache manager is the user's own" in cache.line()
