"""bench/kernel_registers.py: ptxas's register and spill lines are read right, and a kernel compiled offline for
sm_90 with the runtime's divisibility hints reports what ptxas says of it (no GPU needed)."""

import pytest

from bench import kernel_registers as kr

PTXAS_LOG = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'range_attn_bwd_dkdv_kernel' for 'sm_90a'
ptxas info    : Function properties for range_attn_bwd_dkdv_kernel
    8 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size
"""


def test_parse_ptxas_reads_registers_and_spills():
    assert kr.parse_ptxas(PTXAS_LOG) == {"registers": 255, "spill_stores": 4, "spill_loads": 8}


def test_parse_ptxas_refuses_a_log_without_one_kernel():
    with pytest.raises(ValueError, match="expected one kernel"):
        kr.parse_ptxas("ptxas info    : 0 bytes gmem\n")
    with pytest.raises(ValueError, match="expected one kernel"):
        kr.parse_ptxas(PTXAS_LOG + PTXAS_LOG)


def test_a_kernel_compiles_offline_and_reports_its_registers():
    # row_dot_kernel: one load and a reduction per row, so a few dozen registers and no spills with the hints.
    result = kr.compile_case("nsa_model.kernels.delta", "row_dot_kernel", dict(DELTA="fp32"),
                             dict(num_rows="i32"), dict(D=64, BLOCK_R=32, BLOCK_D=64),
                             dict(num_warps=4, num_stages=2))
    assert 8 <= result["registers"] <= 96
    assert result["spill_stores"] == 0 and result["spill_loads"] == 0
