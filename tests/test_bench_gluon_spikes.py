"""The Gluon spikes (bench/gluon_window_fwd.py, bench/gluon_by_block_fwd.py, bench/gluon_selected_fwd.py,
bench/gluon_compressed_fwd.py, bench/gluon_compressed_dq.py, bench/gluon_compressed_dkdv.py): their
kernels compile for Hopper here, the launchers refuse what they do not take, and the reports say what ran.

The kernels need an sm_90 GPU to run (Gluon has no interpreter); their values were checked on the H100 against
the tl kernels (bench/results/gluon-window-fwd-h100-2026-11-25-*.md: o within 2e-3, lse within 1e-6;
gluon-by-block-fwd-h100-2026-11-25-v30i-checked.md: bit for bit; gluon-selected-fwd-h100-2026-11-27-v52*.md: o within
2e-3 and lse within 2e-6 of the tl tiled kernel's, every slot written). Here the compile keeps the scripts honest as
Triton moves: the same offline path as tests/test_triton_compile.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Everything that imports Gluon runs in a subprocess: Gluon reads TRITON_INTERPRET once, on import, and the
# interpreted kernel tests (test_triton_kernels.py) need it imported with TRITON_INTERPRET=1 in this process.
CALL = r"""
import importlib.util, json, sys
name, function, args = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location(name, f"bench/{name}.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
if function == "report":
    print(module.report(*args))
else:  # a launcher on CPU tensors: what it refuses, and why
    import torch
    q = torch.zeros(*args[0], dtype=torch.bfloat16)
    kv = torch.zeros(*args[1], dtype=torch.bfloat16)
    try:
        getattr(module, function)(q, kv, kv, *args[2:])
    except ValueError as exc:
        print("ValueError:", exc)
"""


def _call(name, function, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CALL, json.dumps([name, function, list(args)])], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout

COMPILE = r"""
import importlib.util, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, name, const = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = getattr(spike, name)
H, G, D, BM, BN = const["H"], const["G"], const["D"], const["BLOCK_M"], const["BLOCK_N"]
q = torch.empty(8192, H * D, dtype=torch.bfloat16)
kv = torch.empty(8192, G * D, dtype=torch.bfloat16)
descs = dict(q_desc=spike._desc(q, [BM, D]), k_desc=spike._desc(kv, [BN, D]), v_desc=spike._desc(kv, [BN, D]),
             o_desc=spike._desc(q, [BM, D]))
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else "*fp32" if a == "LSE"
       else "fp32" if a == "qk_scale" else "i32" for a in fn.arg_names}
k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=const["num_warps"]))
ptx = k.asm["ptx"]
print(json.dumps(dict(cubin=len(k.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"),
                      waits=ptx.count("wgmma.wait_group"), tma=ptx.count("cp.async.bulk.tensor"))))
"""

D64 = dict(H=12, G=2, D=64, BLOCK_M=64, BLOCK_N=64, num_warps=4)


@pytest.mark.parametrize("name, const", [
    ("window_fwd_kernel", dict(D64, STAGES=2, OVERLAP=True, EXP=0)),
    ("window_fwd_kernel", dict(D64, STAGES=2, OVERLAP=False, EXP=2)),
    ("window_fwd_kernel", dict(H=64, G=4, D=128, BLOCK_M=128, BLOCK_N=64, num_warps=8, STAGES=3, OVERLAP=True,
                               EXP=0)),
    ("window_fwd_persistent_kernel", dict(D64, STAGES=3)),
], ids=["overlap", "tl-order-poly", "d128-8warps", "persistent"])
def test_spike_kernel_compiles_for_hopper(name, const, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    spec = json.dumps([str(ROOT / "bench" / "gluon_window_fwd.py"), name, const])
    run = subprocess.run([sys.executable, "-c", COMPILE, spec], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["cubin"] > 0
    # QK^T and PV as warpgroup MMAs fed by TMA copies, waited on by hand: the point of writing it in Gluon
    assert out["wgmma"] > 0 and out["waits"] >= 3 and out["tma"] > 0


def test_report_lists_every_variant_against_tl():
    meta = dict(device="H100", date="2026-11-25T06:00:00", commit="abc1234", torch="2.11", triton="3.6.0",
                window=512, note="a remark")
    variant = dict(block_m=64, block_n=64, stages=2, num_warps=4, overlap=True, exp="mufu", ms=0.2, tflops=300.0,
                   vs_tl=1.25, o_err=1e-3, lse_err=1e-6)
    rows = [dict(shape="125m_4x8k", B=4, T=8192, H=12, G=2, D=64, tl_ms=0.25, tl_tflops=240.0,
                 cudnn_fwd_tflops=440.0,
                 variants=[variant, dict(variant, overlap=False, exp="poly", ms=0.5, vs_tl=0.5),
                           dict(block_m=64, block_n=64, stages=3, num_warps=4, persistent=3, overlap=True,
                                exp="mufu", error="OutOfResources: shared memory")])]
    text = _call("gluon_window_fwd", "report", meta, rows)
    assert "commit abc1234" in text and "window w = 512" in text and "Note: a remark" in text
    assert "tl `range_attn_fwd_kernel`: 0.250 ms, 240 TFLOP/s" in text and "440 TFLOP/s" in text
    assert "| 64x64, 2 stages, 4 warps, overlap, exp mufu | 0.200 | 300 | 1.250 | 0.001 | 1e-06 |" in text
    assert "| 64x64, 2 stages, 4 warps, tl order, exp poly | 0.500 | 300 | 0.500 |" in text
    assert "| persistent (3 per SM), 64x64, 3 stages, 4 warps | OutOfResources: shared memory |" in text


def test_launchers_refuse_tiles_that_do_not_divide_t():
    for launch in ("window_fwd", "window_fwd_persistent"):
        for block_m, block_n in ((128, 64), (64, 128)):  # T = 192 fits 64 but neither 128
            out = _call("gluon_window_fwd", launch, [1, 192, 12, 64], [1, 192, 2, 64], 512, 0.125, block_m, block_n)
            assert f"ValueError: the spike needs T (192) a multiple of the tiles ({block_m}, {block_n})" in out


COMPILE_BY_BLOCK = r"""
import importlib.util, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, const, maxnreg = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = spike.by_block_fwd_ws_kernel
kv = torch.empty(8192, 2 * 64, dtype=torch.bfloat16)
descs = dict(k_desc=spike._desc(kv, [64, 64]), v_desc=spike._desc(kv, [64, 64]))
pointers = dict(Q="*bf16", ORDER="*i32", STARTS="*i32", WORK_SEG="*i32", WORK_CHUNK="*i32", O_PART="*bf16",
                LSE2_PART="*fp32")
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else pointers.get(a)
       or ("fp32" if a == "qk_scale" else "i32") for a in fn.arg_names}
# pointers 16-byte aligned, as the launcher's tensors are (cp.async copies 16 bytes a thread only then)
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in pointers}
k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4, maxnreg=maxnreg))
ptx = k.asm["ptx"]
print(json.dumps(dict(cubin=len(k.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"),
                      gathers=ptx.count("cp.async.cg.shared.global"), setmaxnreg=ptx.count("setmaxnreg"))))
"""

BY_BLOCK = dict(H=12, G=2, D=64, SEL_BLOCK=64, N_SELECT=16, ROWS=64, CHUNK=512, PRODUCER_WARPS=4, PRODUCER_REGS=48,
                num_warps=4)


@pytest.mark.parametrize("const, maxnreg", [
    (dict(BY_BLOCK, STAGES=4, LAG=2, WHOLE_CHECK=False, COALESCED=True, OVERLAP=True), 128),
    (dict(BY_BLOCK, STAGES=3, LAG=0, WHOLE_CHECK=True, COALESCED=False, OVERLAP=False), 96),
], ids=["overlap", "plain"])
def test_by_block_spike_compiles_warp_specialized(const, maxnreg, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    spec = json.dumps([str(ROOT / "bench" / "gluon_by_block_fwd.py"), const, maxnreg])
    run = subprocess.run([sys.executable, "-c", COMPILE_BY_BLOCK, spec], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # a gather warp group (16-byte cp.async copies) beside the math warps, registers moved between them
    assert out["cubin"] > 0 and out["wgmma"] > 0 and out["gathers"] > 0 and out["setmaxnreg"] > 0


def test_by_block_report_and_refusals():
    meta = dict(device="H100", date="2026-11-25T06:19:00", commit="abc1234", torch="2.11", triton="3.6.0",
                note="timings only")
    variant = dict(stages=4, producer_warps=4, producer_regs=48, maxnreg=128, lag=2, whole_check=False,
                   coalesced=True, overlap=False, ms=0.56, vs_tl=1.052, same_written=True, same_empty=True,
                   o_err=0.0, lse_err=0.0)
    rows = [dict(shape="125m_4x8k", B=4, T=8192, H=12, G=2, D=64, tl_ms=0.589,
                 variants=[variant, dict(variant, error="CompilationError: no")])]
    text = _call("gluon_by_block_fwd", "report", meta, rows)
    assert "tl `selected_block_fwd_kernel`: 0.589 ms" in text and "Note: timings only" in text
    assert "| 4 | 4 | 48 | 128 | 2 | False | True | False | 0.560 | 1.052 | True, True | 0 | 0 |" in text
    assert "| 4 | 4 | 48 | 128 | 2 | False | True | False | CompilationError: no |" in text
    out = _call("gluon_by_block_fwd", "by_block_fwd_ws", [1, 128, 12, 128], [1, 128, 2, 128], None, 0.1, 16)
    assert "ValueError: the spike takes head dim 64 and T a multiple of 64; got D=128, T=128" in out


COMPILE_SELECTED = r"""
import importlib.util, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, const, maxnreg = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = spike.selected_shared_fwd_kernel
kv = torch.empty(8192, 4 * 128, dtype=torch.bfloat16)
descs = dict(k_desc=spike._desc(kv, [64, 128]), v_desc=spike._desc(kv, [64, 128]))
pointers = dict(Q="*bf16", BLOCKS="*i32", UNION="*i32", COUNT="*i32", O="*bf16", LSE="*fp32")
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else pointers.get(a)
       or ("fp32" if a == "qk_scale" else "i32") for a in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in pointers}
k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4, maxnreg=maxnreg))
ptx = k.asm["ptx"]
print(json.dumps(dict(cubin=len(k.asm["cubin"]), mma=ptx.count("mma.sync.aligned.m16n8k16"),
                      ldmatrix=ptx.count("ldmatrix"), tma=ptx.count("cp.async.bulk.tensor"),
                      setmaxnreg=ptx.count("setmaxnreg"), arrive_lane0=ptx.count("mbarrier.arrive.shared::cta.b64"))))
"""

SELECTED = dict(H=64, G=4, D=128, SEL_BLOCK=64, N_SELECT=16, N_PAD=16, STAGES=3, PROBE=0)


@pytest.mark.parametrize("const, maxnreg", [
    (dict(SELECTED, QUERIES=4, WORKER_REGS=216), 128),
    (dict(SELECTED, QUERIES=8, WORKER_REGS=232), 168),
], ids=["4-queries", "8-queries"])
def test_selected_spike_compiles_one_warp_per_query(const, maxnreg, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    spec = json.dumps([str(ROOT / "bench" / "gluon_selected_fwd.py"), const, maxnreg])
    run = subprocess.run([sys.executable, "-c", COMPILE_SELECTED, spec], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    queries = const["QUERIES"]
    # each query warp: S = q K^T and P V as warp MMAs, 64 m16n8k16 each at head dim 128 and l' = 64; its operands
    # from shared memory by ldmatrix; the loader's TMA copies; registers moved to the query warps; one arrive a warp
    assert out["cubin"] > 0 and out["mma"] == 128 * queries and out["ldmatrix"] > 0 and out["tma"] > 0
    assert out["setmaxnreg"] > 0 and out["arrive_lane0"] == queries


def test_selected_report_and_refusals():
    meta = dict(device="H100", date="2026-11-27T19:06:00", commit="abc1234", torch="2.11", triton="3.6.0")
    variant = dict(queries=4, stages=3, worker_regs=216, maxnreg=128, same_empty=True, nan_left=0, o_err=0.002,
                   lse_err=1.4e-6, ms=2.857, vs_tiled=0.512, vs_per_query=0.663)
    rows = [dict(shape="paper_1x8k", B=1, T=8192, H=64, G=4, D=128, tiled_ms=1.462, per_query_ms=1.895,
                 probe1_ms=4.219, probe2_ms=1.011,
                 variants=[variant, dict(variant, queries=8, maxnreg=None, error="OutOfResources: registers")])]
    text = _call("gluon_selected_fwd", "report", meta, rows)
    assert "tl tiled: 1.462 ms; tl per query: 1.895 ms" in text
    assert "every query warp computing on every block 4.219 ms; none computing" in text and "1.011 ms" in text
    assert "| 4 | 3 | 216 | 128 | 2.857 | 0.512 | 0.663 | True, 0 | 0.002 | 1.4e-06 |" in text
    assert "| 8 | 3 | 216 | - | OutOfResources: registers |" in text
    out = _call("gluon_selected_fwd", "selected_shared_fwd", [1, 128, 12, 64], [1, 128, 2, 64], None, 0.1)
    assert "ValueError: the spike takes 16 heads a group, head dim 128 and bf16; got H/G=6, D=64" in out


COMPILE_COMPRESSED = r"""
import importlib.util, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, const, maxnreg = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = spike.compressed_fwd_ws_kernel
H, G, D, BN = const["H"], const["G"], const["D"], const["BLOCK_N"]
rows = const["BLOCK_M"] // (2 if const["SPLIT"] else 1)
q = torch.empty(8192, H * D, dtype=torch.bfloat16)
kv = torch.empty(511, G * D, dtype=torch.bfloat16)
descs = dict(q_desc=spike._desc(q, [rows, D]), k_desc=spike._desc(kv, [BN, D]), v_desc=spike._desc(kv, [BN, D]),
             o_desc=spike._desc(q, [rows, D]))
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else "*fp32" if a == "LSE"
       else "fp32" if a == "qk_scale" else "i32" for a in fn.arg_names}
k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=const["num_warps"], maxnreg=maxnreg))
ptx = k.asm["ptx"]
# a warpgroup MMA whose left operand is registers names a register list after its accumulator's
reg_a = len(re.findall(r"wgmma\.mma_async[^;]*\}, \{%r", ptx))
regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
print(json.dumps(dict(cubin=len(k.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"), reg_a=reg_a, regs=regs,
                      tma=ptx.count("cp.async.bulk.tensor"), arrives=ptx.count("mbarrier.arrive"))))
"""

COMPRESSED = dict(H=64, G=4, D=128, BLOCK_M=128, LOADER_WARPS=4, LOADER_REGS=24)


@pytest.mark.parametrize("const, wgmma, reg_a, arrives", [
    # two 4-warp consumers, q in registers, taking turns. Warpgroup MMAs: 2 consumers x (Q K^T before the loop and
    # in it, 8 k-steps each at head dim 128; P V in it and after it, 4 k-steps each at 64 keys) = 48, all with a
    # register left operand (q, P). Arrives: the loader's q and K/V copies, each consumer's two frees of a slot
    # (in and after the loop) and its turn handed over
    (dict(COMPRESSED, BLOCK_N=64, STAGES=3, SPLIT=1, PINGPONG=1, Q_IN_REGS=1, CONSUMER_REGS=240, num_warps=4), 48,
     48, 8),
    # the same without turns, q from shared memory: only the P V products take registers; no turn arrives
    (dict(COMPRESSED, BLOCK_N=64, STAGES=3, SPLIT=1, PINGPONG=0, Q_IN_REGS=0, CONSUMER_REGS=240, num_warps=4), 48,
     16, 6),
    # one 8-warp consumer, 128-key tiles: (8 + 8) Q K^T + (8 + 8) P V
    (dict(COMPRESSED, BLOCK_N=128, STAGES=2, SPLIT=0, PINGPONG=0, Q_IN_REGS=0, CONSUMER_REGS=0, num_warps=8), 32,
     16, 4),
], ids=["two-consumers-turns-q-regs", "two-consumers", "one-consumer"])
def test_compressed_spike_compiles_warp_specialized(const, wgmma, reg_a, arrives, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    spec = json.dumps([str(ROOT / "bench" / "gluon_compressed_fwd.py"), const, 168])
    run = subprocess.run([sys.executable, "-c", COMPILE_COMPRESSED, spec], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["cubin"] > 0 and out["tma"] >= 3  # the loader's q, k and v copies
    assert (out["wgmma"], out["reg_a"], out["arrives"]) == (wgmma, reg_a, arrives)
    # registers moved from the loader (24) to the consumers (240)
    assert 24 in out["regs"] and 240 in out["regs"]


def test_compressed_report_and_refusals():
    meta = dict(device="H200", date="2026-12-03 18:15 UTC", commit="abc1234", torch="2.11", triton="3.6.0")
    variant = dict(block_n=64, stages=3, split=1, pingpong=1, q_in_regs=1, loader_warps=4, loader_regs=24,
                   consumer_regs=240, maxnreg=168, o_err=0.0078, lse_err=1.9e-6, same_empty=True, ms=8.689,
                   tflops=506.0, vs_tl=1.086)
    rows = [dict(shape="paper_1x65536", B=1, T=65536, H=64, G=4, D=128, tl_ms=9.44, tl_tflops=466.0,
                 cudnn_fwd_tflops=594.0,
                 variants=[variant, dict(variant, split=0, pingpong=0, q_in_regs=0, error="no result within 100 s")])]
    text = _call("gluon_compressed_fwd", "report", meta, rows)
    assert "tl `range_attn_fwd_kernel` (compressed only): 9.440 ms, 466 TFLOP/s" in text and "594 TFLOP/s" in text
    assert ("| 128x64, 3 stages, 2 x 4 warps, turns, q in registers, loader 4 warps, maxnreg 168 | 8.689 | 506 | "
            "1.086 | 0.0078 | 1.9e-06 |") in text
    assert "| 128x64, 3 stages, 1 x 8 warps, loader 4 warps, maxnreg 168 | no result within 100 s |" in text
    out = _call("gluon_compressed_fwd", "compressed_fwd_ws", [1, 192, 64, 128], [1, 11, 4, 128], 0.1)
    assert "ValueError: the spike needs T (192) a multiple of the query tile (128)" in out
    out = _call("gluon_compressed_fwd", "compressed_fwd_ws", [1, 128, 6, 96], [1, 7, 2, 96], 0.1)
    assert "ValueError: the spike takes head dim 64 or 128 and H a multiple of G; got D=96, H=6, G=2" in out


COMPILE_COMPRESSED_DQ = r"""
import importlib.util, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, const = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = spike.compressed_dq_ws_kernel
H, G, D, BN, rows = const["H"], const["G"], const["D"], const["BLOCK_N"], const["BLOCK_M"] // 2
q = torch.empty(8192, H * D, dtype=torch.bfloat16)
kv = torch.empty(511, G * D, dtype=torch.bfloat16)
descs = dict(q_desc=spike._desc(q, [rows, D]), do_desc=spike._desc(q, [rows, D]), k_desc=spike._desc(kv, [BN, D]),
             v_desc=spike._desc(kv, [BN, D]))
pointers = dict(LSE="*fp32", DELTA="*fp32", DQ="*bf16")
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else pointers.get(a)
       or ("fp32" if a in ("qk_scale", "scale") else "i32") for a in fn.arg_names}
k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=const["num_warps"], maxnreg=168))
ptx = k.asm["ptx"]
reg_a = len(re.findall(r"wgmma\.mma_async[^;]*\}, \{%r", ptx))
regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
print(json.dumps(dict(cubin=len(k.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"), reg_a=reg_a, regs=regs,
                      tma=ptx.count("cp.async.bulk.tensor"), arrives=ptx.count("mbarrier.arrive"))))
"""


@pytest.mark.parametrize("qo_in_regs, reg_a", [(1, 40), (0, 8)], ids=["q-do-in-registers", "q-do-shared"])
def test_compressed_dq_spike_compiles_warp_specialized(qo_in_regs, reg_a, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    const = dict(COMPRESSED, BLOCK_N=64, STAGES=3, QO_IN_REGS=qo_in_regs, CONSUMER_REGS=240, num_warps=4)
    spec = json.dumps([str(ROOT / "bench" / "gluon_compressed_dq.py"), const])
    run = subprocess.run([sys.executable, "-c", COMPILE_COMPRESSED_DQ, spec], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # two consumers x (S = q K^T and dP = dO V^T, 8 k-steps each at head dim 128; dQ += dS K, 4 at 64 keys) = 40
    # warpgroup MMAs; with q and dO in registers all 40 take a register left operand, else only dS K's 8. Arrives:
    # the loader's two expects, each consumer's free of a slot and its turn handed over
    assert out["cubin"] > 0 and out["tma"] >= 4  # the loader's q, dO, k and v copies
    assert (out["wgmma"], out["reg_a"], out["arrives"]) == (40, reg_a, 6)
    assert 24 in out["regs"] and 240 in out["regs"]


def test_compressed_dq_report():
    meta = dict(device="H200", date="2026-12-03 19:18 UTC", commit="abc1234", torch="2.11", triton="3.6.0")
    variant = dict(block_n=64, stages=2, qo_in_regs=0, loader_warps=4, loader_regs=24, consumer_regs=240,
                   maxnreg=168, dq_err=0.0, ms=10.84, tflops=608.0, vs_tl=0.965)
    rows = [dict(shape="paper_1x65536", B=1, T=65536, H=64, G=4, D=128, tl_ms=10.464, tl_tflops=630.0,
                 variants=[variant, dict(variant, qo_in_regs=1, error="no result within 100 s")])]
    text = _call("gluon_compressed_dq", "report", meta, rows)
    assert "tl `range_attn_bwd_dq_kernel` (compressed range only): 10.464 ms, 630 TFLOP/s" in text
    assert "| 128x64, 2 stages, 2 x 4 warps, turns, loader 4 warps, maxnreg 168 | 10.840 | 608 | 0.965 | 0 |" in text
    assert ("| 128x64, 2 stages, 2 x 4 warps, turns, q and dO in registers, loader 4 warps, maxnreg 168 | no result "
            "within 100 s |") in text


COMPILE_COMPRESSED_DKDV = r"""
import importlib.util, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

path, const = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("spike", path)
spike = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spike)
fn = spike.compressed_dkdv_ws_kernel
H, G, D, BQ, BK = const["H"], const["G"], const["D"], const["BLOCK_Q"], const["BLOCK_K"]
q = torch.empty(8192, H * D, dtype=torch.bfloat16)
kv = torch.empty(511, G * D, dtype=torch.bfloat16)
descs = dict(q_desc=spike._desc(q, [BQ, D]), do_desc=spike._desc(q, [BQ, D]), k_desc=spike._desc(kv, [BK // 2, D]),
             v_desc=spike._desc(kv, [BK // 2, D]))
pointers = dict(LSE_T="*fp32", DELTA_T="*fp32", DK_ACC="*fp32", DV_ACC="*fp32")
sig = {a: "constexpr" if a in const else mangle_type(descs[a]) if a in descs else pointers.get(a)
       or ("fp32" if a in ("qk_scale", "scale") else "i32") for a in fn.arg_names}
k = triton.compile(GluonASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=const["num_warps"], maxnreg=168))
ptx = k.asm["ptx"]
reg_a = len(re.findall(r"wgmma\.mma_async[^;]*\}, \{%r", ptx))
regs = sorted({int(r) for r in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
print(json.dumps(dict(cubin=len(k.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"), reg_a=reg_a, regs=regs,
                      tma=ptx.count("cp.async.bulk.tensor"), arrives=ptx.count("mbarrier.arrive"),
                      float_adds=len(re.findall(r"red\.[^;]*add\.f32|atom\.[^;]*add\.f32", ptx)))))
"""


@pytest.mark.parametrize("block_q, wgmma", [(64, 48), (32, 40)], ids=["64-query-steps", "32-query-steps"])
def test_compressed_dkdv_spike_compiles_warp_specialized(block_q, wgmma, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    const = dict(H=64, G=4, D=128, BLOCK_K=128, BLOCK_Q=block_q, STAGES=2, HEADS=1, LOADER_WARPS=4, LOADER_REGS=24,
                 CONSUMER_REGS=240, num_warps=4)
    spec = json.dumps([str(ROOT / "bench" / "gluon_compressed_dkdv.py"), const])
    run = subprocess.run([sys.executable, "-c", COMPILE_COMPRESSED_DKDV, spec], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # two consumers x (S^T = K q^T and dP^T = V dO^T, 8 k-steps each at head dim 128; dV += P^T dO and
    # dK += dS^T q, block_q / 16 each): 48 or 40 warpgroup MMAs, the two accumulating ones with a register left
    # operand; arrives: the loader's expects (K/V once, q/dO a step), each consumer's free and turn; the float32
    # dK and dV adds at the end
    assert out["cubin"] > 0 and out["tma"] >= 4  # the loader's k, v, q and dO copies
    assert (out["wgmma"], out["reg_a"], out["arrives"]) == (wgmma, 2 * 2 * block_q // 16, 6)
    assert 24 in out["regs"] and 240 in out["regs"] and out["float_adds"] > 0


def test_compressed_dkdv_report():
    meta = dict(device="H200", date="2026-12-03 19:24 UTC", commit="abc1234", torch="2.11", triton="3.6.0")
    variant = dict(block_q=64, stages=2, heads=1, q_chunk=4096, loader_warps=4, loader_regs=24, consumer_regs=240,
                   maxnreg=168, dk_err=7.7e-4, dv_err=4.5e-4, ms=17.68, tflops=497.0, vs_tl=1.013)
    rows = [dict(shape="paper_1x65536", B=1, T=65536, H=64, G=4, D=128, tl_ms=17.916, tl_tflops=491.0,
                 variants=[variant, dict(variant, heads=16, error="no result within 100 s")])]
    text = _call("gluon_compressed_dkdv", "report", meta, rows)
    assert "tl `range_attn_bwd_dkdv_kernel` (compressed range only): 17.916 ms, 491 TFLOP/s" in text
    assert ("| 128 keys x 64 queries, 2 stages, 1 heads a program, chunks of 4096, 2 x 4 warps, turns, maxnreg 168 "
            "| 17.680 | 497 | 1.013 | 0.00077 | 0.00045 |") in text
    assert "| 128 keys x 64 queries, 2 stages, 16 heads a program, chunks of 4096" in text
    assert "no result within 100 s" in text
