"""bench/model_step.py: the memory breakdown (an allocator trace's peak and what is alive then, by site) and the kernel
difference between the NSA and the dense step."""

import importlib.util
import sys
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "bench" / "model_step.py"
_spec = importlib.util.spec_from_file_location("model_step", _path)
model_step = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(_path.parent.parent))
_spec.loader.exec_module(model_step)

MIB = 2**20


def frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


SAVED = [frame("/x/site-packages/torch/nn/functional.py", 10, "linear"), frame("/r/nsa_model/attention.py", 120, "forward")]
TRANSIENT = [frame("/r/nsa_model/ops/triton_impl.py", 454, "_selected_by_block_fwd")]
HEAD = [frame("/tmp/torchinductor_root/ab/cabc.py", 77, "call")]


def alloc(addr, mib, frames):
    return {"action": "alloc", "addr": addr, "size": mib * MIB, "frames": frames}


def free(addr, mib):
    return {"action": "free_completed", "addr": addr, "size": mib * MIB}


def test_peak_sites_are_what_is_alive_at_the_peak_by_innermost_project_frame():
    events = [
        free(999, 50),  # allocated before the trace: not counted, and the running total never goes below zero
        alloc(1, 100, SAVED), alloc(2, 300, TRANSIENT), free(2, 300),  # a transient peak of 400
        alloc(3, 100, SAVED), alloc(4, 250, HEAD),  # the peak: 100 + 100 + 250 = 450
        {"action": "free_requested", "addr": 4, "size": 250 * MIB},  # not yet free: ignored
        free(4, 250), alloc(5, 10, []),
    ]
    out = model_step.peak_sites(events, top=1)
    assert out["traced_peak_mib"] == pytest.approx(450)
    assert out["sites"] == [{"site": "cabc.py:77 call", "mib": 250.0, "tensors": 1}]
    assert out["rest_mib"] == pytest.approx(200)
    both = model_step.peak_sites(events)["sites"]
    assert both[1] == {"site": "nsa_model/attention.py:120 forward", "mib": 200.0, "tensors": 2}
    assert len(both) == 2  # the transient kernel buffer was freed before the peak


def test_kernel_difference_ranks_non_core_kernels_by_the_gap_between_nsa_and_dense():
    nsa = {"selected_block_bwd_kernel": {"ms": 30.0, "calls": 24},  # the NSA core: left out
           "nvjet_sm90_gemm": {"ms": 66.0, "calls": 300},
           "triton_poi_fused_rope_3": {"ms": 5.0, "calls": 48},
           "void at::native::FillFunctor<float>": {"ms": 1.0, "calls": 96}}
    dense = {"nvjet_sm90_gemm": {"ms": 62.0, "calls": 250},
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop": {"ms": 18.0, "calls": 24},
             "void at::native::FillFunctor<float>": {"ms": 1.5, "calls": 24}}
    rows = model_step.kernel_difference(nsa, dense)
    assert [r[0] for r in rows] == ["cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "triton_poi_fused_rope_3",
                                    "nvjet_sm90_gemm", "void at::native::FillFunctor<float>"]
    assert rows[1] == ("triton_poi_fused_rope_3", 5.0, 0.0, 48, 0)
    assert rows[2] == ("nvjet_sm90_gemm", 66.0, 62.0, 300, 250)
    assert len(model_step.kernel_difference(nsa, dense, top=2)) == 2


def test_the_report_names_the_graphs_run_without_cuda_graphs():
    meta = {"device": "H100", "date": "2026-11-23", "commit": "abc", "torch": "2.11", "preset": "nsa-125m",
            "tokens_per_step": 65536, "micro_tokens": 32768, "eager": False, "warmup": 3, "measure": 5,
            "compile_mode": "reduce-overhead"}
    row = {"seq_len": 2048, "tokens_per_s": 3e5, "step_s": 0.2, "mfu": 0.25, "peak_mib": 5e3, "peak_reserved_mib": 2.6e4}
    rows = [{**row, "attention": "nsa", "cudagraph_skips": 1}, {**row, "attention": "dense", "cudagraph_skips": 0}]
    text = model_step.markdown(meta, rows)
    assert "without CUDA graphs (inductor's cudagraph_skips): nsa T=2048: 1, dense T=2048: 0." in text
    assert "cudagraph_skips" not in model_step.markdown({**meta, "compile_mode": "default"}, [{**row, "attention": "nsa"}])
    assert "launch config changed: {'slc_kernel': 'by_block'}." in model_step.markdown(
        {**meta, "launch_overrides": {"slc_kernel": "by_block"}}, rows)


def test_the_step_table_shows_a_row_without_a_profile_as_dashes_not_zeros():
    """--no-profile rows once read "0.0 / 0.0" GPU busy ms, as if measured; a profiled row keeps its figures, the
    other categories summed."""
    meta = {"device": "H100", "date": "2026-11-26", "commit": "abc", "torch": "2.11", "preset": "nsa-125m",
            "tokens_per_step": 65536, "micro_tokens": 32768, "eager": False, "warmup": 3, "measure": 5}
    row = {"seq_len": 8192, "tokens_per_s": 3.4e5, "step_s": 0.1935, "mfu": 0.3, "peak_mib": 1931, "peak_reserved_mib": 2e4}
    profile = {"wall_ms": 198.8, "gpu_busy_ms": 197.3, "categories_ms": {
        "nsa core (triton)": 84.5, "matmul (cuBLAS)": 62.7, "compiled glue (inductor)": 35.6, "other (torch eager)": 13.4,
        "sort/scan (torch)": 1.0}}
    lines = model_step.markdown(meta, [{**row, "attention": "nsa"}]).split("\n")
    assert "| nsa | 8192 | 340,000 | 193.5 | 0.300 | 1,931 / 20,000 | - / - | - | - | - | - |" in lines
    assert model_step._profile_cells(profile) == "198.8 / 197.3 | 84.5 | 62.7 | 35.6 | 14.4"


def test_launch_overrides_parse_literals_and_words_and_refuse_a_bare_name():
    got = model_step.launch_overrides(["slc_auto_tiled_fwd_blocks=8", "slc_kernel=by_block",
                                       "range_fwd=(64, 64, 4, 3)"])
    assert got == {"slc_auto_tiled_fwd_blocks": 8, "slc_kernel": "by_block", "range_fwd": (64, 64, 4, 3)}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        model_step.launch_overrides(["slc_kernel"])


def test_timeline_counts_idle_time_where_no_stream_runs_and_names_the_kernels_around_each_gap():
    # stream 7: a 0-10, b 30-40; stream 9 (beside it): w 5-20, then c 50-55 after a gap
    activity = [("a", 0.0, 10.0, "7"), ("w", 5.0, 15.0, "9"), ("b", 30.0, 10.0, "7"), ("c", 50.0, 5.0, "9"),
                ("a", 60.0, 10.0, "7"), ("w", 62.0, 3.0, "9")]
    tl = model_step.timeline(activity)
    assert tl["span_ms"] * 1e3 == pytest.approx(70.0)
    assert tl["busy_ms"] * 1e3 == pytest.approx(20.0 + 10.0 + 5.0 + 10.0)  # the union over both streams
    assert tl["idle_ms"] * 1e3 == pytest.approx(25.0)  # 20-30, 40-50, 55-60
    assert tl["concurrent_ms"] * 1e3 == pytest.approx(5.0 + 3.0)  # a and w overlap 5-10; w inside a 62-65
    assert tl["streams"] == 2
    gaps = {(g["before"], g["after"]): (g["ms"] * 1e3, g["count"]) for g in tl["gaps"]}
    # the gap after 20 follows w (it ended last), not a
    assert gaps == {("w", "b"): (pytest.approx(10.0), 1), ("b", "c"): (pytest.approx(10.0), 1),
                    ("c", "a"): (pytest.approx(5.0), 1)}
    assert [g["ms"] for g in tl["gaps"]] == sorted((g["ms"] for g in tl["gaps"]), reverse=True)
    assert model_step.timeline([])["idle_ms"] == 0.0


def test_trace_activity_keeps_the_gpus_kernels_memsets_and_copies_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 2, "tid": 7},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 8, "dur": 1, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 9, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1, "tid": 1},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 5, "tid": 7}]}
    assert model_step.trace_activity(trace) == [("k", 5.0, 2.0, "7"), ("Memset", 8.0, 1.0, "7")]


def test_the_modes_that_replay_cuda_graphs_are_the_ones_torch_compile_gives_them():
    """The step keeps its gradients outside the graphs (FlatGradients) exactly where inductor replays CUDA graphs:
    torch.compile's own option table says which modes turn on triton.cudagraphs."""
    from torch._inductor import list_mode_options
    assert set(model_step.CUDA_GRAPH_MODES) <= set(model_step.COMPILE_MODES)
    for mode in model_step.COMPILE_MODES:
        graphs = bool(list_mode_options(mode).get("triton.cudagraphs", False))
        assert (mode in model_step.CUDA_GRAPH_MODES) == graphs, mode
