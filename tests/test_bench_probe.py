"""The timing probes build their kernel variants by editing the kernels' source (bench/kernel_variants.py): each
edit must still find its text, or the probe would skip that variant without anyone noticing."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_interpreted(code: str) -> str:
    """stdout of `code` run in a fresh Python with the Triton interpreter on, failing the test where it fails. In
    a subprocess: the probes import the triton backend, which this test session imports interpreted."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _variants_applied(probe: str, edits: str) -> int:
    """How many of the probe's variants (`edits`: an expression over the probe module p) build, failing if any is
    skipped."""
    code = (f"import bench.{probe} as p\n"
            f"edits = {edits}\n"
            "missing = [n for n, e in edits.items() if p.variant(n, e) is None]\n"
            "assert not missing, missing\n"
            "print(len(edits))\n")
    return int(_run_interpreted(code).strip())


def test_every_selection_variant_of_the_probe_applies_to_the_kernel_as_it_is():
    assert _variants_applied("probe_v32", "p.SELECT_EDITS") == 4


def test_every_by_block_variant_of_the_probe_applies_to_the_kernels_as_they_are():
    """bench/probe_by_block.py's variants edit kernels/selected_by_block.py the same way."""
    both = ("{**{'forward ' + k: e for k, e in p.FORWARD_EDITS.items()}, "
            "**{'backward ' + k: e for k, e in p.BACKWARD_EDITS.items()}}")
    assert _variants_applied("probe_by_block", both) == 14


def test_every_per_query_variant_of_the_probe_applies_to_the_kernels_as_they_are():
    """bench/probe_per_query.py's variants edit kernels/selected_attention.py: every hint finds its load or store."""
    assert _variants_applied("probe_per_query", "p.VARIANTS") == 2


def test_every_exp2_variant_of_the_probe_applies_to_the_kernels_as_they_are():
    """bench/probe_exp2.py edits every kernel module that exponentiates: each variant builds them all, and each
    module's exponentials are all routed through the variant's helper (none left on the unit by accident)."""
    code = ("import bench.probe_exp2 as p\n"
            "from bench.kernel_variants import KERNELS\n"
            "for name in p.VARIANTS:\n"
            "    if name != 'prod':\n"
            "        assert len(p.kernels_of(name)) == sum(len(k) for k in p.MODULES.values())\n"
            "for module in p.MODULES:\n"
            "    src = KERNELS.joinpath(module).read_text()\n"
            "    for old, new in p.edits('', module):\n"
            "        src = src.replace(old, new)\n"
            "    code = [l for l in src.splitlines() if not l.lstrip().startswith('#')]\n"
            "    assert not any('tl.exp2(' in l or 'tl.exp(' in l for l in code), module\n"
            "for name in p.SELECTION_VARIANTS:\n"
            "    assert p.selection_variant(name) is not None\n"
            "print(len(p.VARIANTS))\n")
    assert int(_run_interpreted(code).strip()) == 5


def test_the_fused_dq_probe_builds_its_kernel_and_its_dq_matches_the_dq_kernel():
    """bench/probe_cmp_dq.py builds FUSED_DQ into kernels/range_attention.py by edits. In the interpreter (fp32,
    absolute query chunks of 128 so that several key tiles add into each dQ row), its element-add dQ must equal the
    compressed range's own dQ kernel, and dK, dV the unedited kernel's (the edits must not touch them)."""
    code = ("import dataclasses, torch\n"
            "import bench.probe_cmp_dq as p\n"
            "from nsa_model.ops import triton_impl as ti\n"
            "tiles = dict.fromkeys(('range_fwd_d64', 'range_dq_d64', 'range_dkdv_d64'), (16, 16, 4, 2))\n"
            "with ti.use_launch_config(dataclasses.replace(ti.LaunchConfig(), range_dkdv_q_chunk=128, **tiles)):\n"
            "    x = p.make_inputs(1, 300, 4, 2, 32, device='cpu', dtype=torch.float32)\n"
            "    assert ti._range_dkdv_split(x['q'], x['kc'], x['vc'], 300, 300)[3]  # absolute chunks\n"
            "    dk0, dv0, _ = p.cmp_dkdv(x, (0, 4, 2))\n"
            "    dq_ref = p.range_dq(x, pair=False, branch='cmp')\n"
            "    dk, dv, dq = p.cmp_dkdv(x, (1, 4, 2))\n"
            "errs = [p.rel_err(dk, dk0), p.rel_err(dv, dv0), p.rel_err(dq, dq_ref)]\n"
            "assert max(errs) < 1e-5 and float(dq_ref.norm()) > 1, errs\n"
            "print(errs)\n")
    _run_interpreted(code)
