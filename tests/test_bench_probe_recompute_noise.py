"""bench/probe_recompute_noise.py sizes the GPU recompute test's tolerance: its spreads must be the largest
relative move over the right pairs of runs, per parameter."""

import torch

from bench.probe_recompute_noise import markdown, spreads


def test_spreads_take_the_largest_move_over_each_kind_of_pair():
    base = torch.tensor([3.0, 4.0])  # norm 5
    kept = [{"w": base}, {"w": base + torch.tensor([0.05, 0.0])}, {"w": base}]
    # the worst kept/recompute pair is off the diagonal (kept[2], recomputed[1]): every pair must be compared
    recomputed = [{"w": base + torch.tensor([0.0, 0.1])}, {"w": base + torch.tensor([0.0, 0.5])}]
    (row,) = spreads(kept, recomputed)
    assert row["parameter"] == "w"
    assert abs(row["norm"] - 5.0) < 1e-6
    assert abs(row["kept vs kept"] - 0.05 / 5) < 1e-6
    assert abs(row["recompute vs recompute"] - 0.4 / (base + torch.tensor([0.0, 0.1])).norm().item()) < 1e-6
    assert abs(row["kept vs recompute"] - 0.5 / 5) < 1e-6  # |(0, 0.5)| / |base|
    text = markdown([row], {"device": "cpu"}, runs=3, T=16)
    assert "| w | 5.000e+00 | 1.00e-02 | 7.87e-02 |" in text
