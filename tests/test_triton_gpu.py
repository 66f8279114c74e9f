"""bf16 checks of the Triton backend on the GPU, up to T = 64k, against a float64 reference computed on the GPU in
query chunks (the checks of bench/kernels.py). Skipped where there is no CUDA; CI has none.

bench/kernels.py is loaded only inside the test: importing it imports the compiled backend, which a CPU-only
session must not do before test_triton_kernels.py imports the interpreted one.
"""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 large-T checks need a CUDA GPU")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "kernels.py")
N_CHECKS = 11  # len(bench/kernels.py CHECKS)


def _bench_module():
    spec = importlib.util.spec_from_file_location("nsa_bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("index", range(N_CHECKS))
def test_bf16_matches_float64_reference(index):
    bench = _bench_module()
    assert len(bench.CHECKS) == N_CHECKS
    case = dict(bench.CHECKS[index])
    name = case.pop("name")
    result = bench.check_bf16(name, cfg=bench.PAPER_NSA, **case)
    assert result["finite"], result
    assert result["selection_rows_differing"] == result["selection_near_ties"], result  # only near-ties may differ
    errors = {k: v for k, v in result.items() if k == "o" or (k.startswith("d") and k[1:] in bench.NAMES)}
    assert max(errors.values()) <= bench.BF16_TOL, errors


def test_core_on_two_streams_matches_one_stream_eager_and_in_a_cuda_graph():
    """side_stream runs the window forward and the range dK/dV on a second stream (ops/triton_impl.py, _Beside):
    the output and every gradient must equal the one-stream run's, called eagerly and replayed as a CUDA graph
    (the graph joins both streams' launches), at a shape where by_block runs (125m, 2 x 4096). Gradients from
    atomics differ in summation order only: within 1e-3 of the norm."""
    bench = _bench_module()
    ti = bench.ti
    cfg = bench.PAPER_NSA
    # All of it off the legacy default stream: autograd keeps the stream each leaf was first used on and waits on
    # it at the end of a backward, which a capture may not do with the default stream (pytorch/pytorch#164302).
    with torch.cuda.stream(torch.cuda.Stream()):
        x = bench.make_inputs(2, 4096, 12, 2, 64, 64, cfg, torch.bfloat16, seed=3)
        leaves = [x[n].requires_grad_() for n in bench.NAMES]
        do = torch.randn(2, 4096, 12, 64, device="cuda", dtype=torch.bfloat16)

        def call():
            o = ti.nsa_attention(*leaves, cfg, scale=0.125)
            return [o, *torch.autograd.grad(o, leaves, do)]

        with ti.use_launch_config(ti.LaunchConfig(side_stream=False)):
            expected = call()
        with ti.use_launch_config(ti.LaunchConfig(side_stream=True)):
            eager = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = call()
            for t in replayed:
                t.zero_()
            graph.replay()
        torch.cuda.synchronize()
    for name, want, got_eager, got_graph in zip(("o", *bench.NAMES), expected, eager, replayed):
        for got in (got_eager, got_graph):
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= 1e-3, (name, err)
    assert torch.equal(eager[0], expected[0])  # the forward has no atomics: the same bits
