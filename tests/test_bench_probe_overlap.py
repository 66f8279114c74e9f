"""bench/probe_overlap.py times the forward's pieces as the core runs them: here its closures, run in the Triton
interpreter at a small shape, give what the float64 reference gives, and its table reports the pair gains."""

import os
import subprocess
import sys

from bench.probe_overlap import markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a subprocess: this session may have imported triton_impl compiled or interpreted, and the probe imports it
# through bench.kernels. Prints the largest relative error of each piece's output against the reference.
PIECES = r"""
import torch
from bench import kernels as kb
from bench.probe_overlap import pieces
from nsa_model.config import NSAConfig
from nsa_model.ops import reference

cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_selected=3, window=8)
B, T, H, G, D = 1, 53, 4, 2, 16
scale = D ** -0.5
x = kb.make_inputs(B, T, H, G, D, D, cfg, torch.float32, seed=3, device="cpu")
fns, outs = pieces(kb.ti, x, cfg, T, scale)
for name, fn in fns.items():
    fn()
x64 = {n: t.double() for n, t in x.items()}
ref = {
    "cmp": reference.compressed_attention(x64["q"], x64["k_cmp"], x64["v_cmp"], cfg, scale)[0],
    "win": reference.window_attention(x64["q"], x64["k_win"], x64["v_win"], cfg.window, scale),
    "slc": reference.selected_attention(x64["q"], x64["k_slc"], x64["v_slc"], outs["blocks"].long(), cfg, scale),
}
for name, want in ref.items():
    got = outs[name][0].double()
    print(name, ((got - want).norm() / want.norm()).item())
"""


def test_pieces_compute_the_forward():
    out = subprocess.run([sys.executable, "-c", PIECES], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    errors = {name: float(err) for name, err in (line.split() for line in out.stdout.splitlines())}
    assert set(errors) == {"cmp", "win", "slc"}
    assert all(err <= 1e-5 for err in errors.values()), errors


def test_table_reports_each_pairs_gain():
    rows = {"paper 1 x 64": {"alone": {"cmp fwd": 2.0, "slc fwd": 4.0},
                             "pairs": {"cmp fwd + slc fwd": {"serial": 6.0, "beside": 5.0}}}}
    meta = dict(device="H200", date="2026-11-29", commit="abc", torch="2", triton="3")
    table = markdown(meta, rows)
    assert "| cmp fwd + slc fwd | 6.000 | 5.000 | 1.000 | 0.50 |" in table  # 1 ms of the shorter piece's 2
    assert "| slc fwd | 4.000 |" in table
