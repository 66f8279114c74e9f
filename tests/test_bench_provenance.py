"""What a GPU result file records about the code that produced it (bench/provenance.py)."""

import argparse
import importlib.util
import pathlib
import shutil
import sys

import pytest

from bench.provenance import code_fingerprint, file_suffix, result_file, result_stem

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_copy(src: pathlib.Path, name: str):
    """The package at src imported under another name (its modules are not imported, only its folder is read)."""
    spec = importlib.util.spec_from_file_location(name, src / "__init__.py", submodule_search_locations=[str(src)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_code_fingerprint_names_the_imported_tree_and_changes_with_any_kernel_source(tmp_path):
    """Two copies of nsa_model with one kernel line apart fingerprint apart, and each names its own folder; the
    same sources fingerprint alike wherever they lie. So an A/B of two trees in one call shows which tree each
    side ran (kernels-notes v43: two such A/Bs had timed one tree against itself)."""
    here = code_fingerprint()
    assert here.endswith(f" at {ROOT / 'nsa_model'}")
    for side in ("a", "b"):
        shutil.copytree(ROOT / "nsa_model", tmp_path / side / "nsa_model",
                        ignore=shutil.ignore_patterns("__pycache__"))
    kernel = tmp_path / "b" / "nsa_model" / "kernels" / "range_attention.py"
    kernel.write_text(kernel.read_text().replace("qk_scale", "qk_scale ", 1))
    a = code_fingerprint(_load_copy(tmp_path / "a" / "nsa_model", "nsa_model_copy_a"))
    b = code_fingerprint(_load_copy(tmp_path / "b" / "nsa_model", "nsa_model_copy_b"))
    assert a.split()[0] == here.split()[0] != b.split()[0]
    assert a.endswith(str(tmp_path / "a" / "nsa_model")) and b.endswith(str(tmp_path / "b" / "nsa_model"))


def test_file_suffix_refuses_names_the_gpu_host_would_not_return():
    assert file_suffix("-v43a_b.1") == "-v43a_b.1"
    with pytest.raises(argparse.ArgumentTypeError, match="letters, digits"):
        file_suffix("-v43,a")


def test_result_files_keep_a_suffix_with_a_dot_and_record_the_code(tmp_path):
    """A suffix may hold a dot: each run's files keep their own names (Path.with_suffix took "-v45a.2" for an
    extension and wrote "-v45a.json", over the first run's file). The stem names the device and the UTC date; the
    meta holds what every bench records about the code it ran."""
    first, meta = result_stem(tmp_path, "probe", "-v45a.1", "abc1234")
    second, _ = result_stem(tmp_path, "probe", "-v45a.2", "abc1234")
    for stem, text in ((first, "one"), (second, "two")):
        result_file(stem, ".json").write_text(text)
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == [f"probe-cpu-{meta['date'][:10]}-v45a.{i}.json" for i in (1, 2)]
    assert [result_file(s, ".json").read_text() for s in (first, second)] == ["one", "two"]
    assert meta["device"] == "cpu" and meta["commit"] == "abc1234" and meta["date"].endswith(" UTC")
    assert meta["nsa_model"] == code_fingerprint() and {"torch", "triton"} <= set(meta)
