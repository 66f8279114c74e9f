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
