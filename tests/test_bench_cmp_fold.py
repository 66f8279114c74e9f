"""bench/probe_cmp_fold.py times cuDNN on the compressed branch with its queries folded: d queries a row, each row
causal over the compressed tokens. The fold must be the compressed branch exactly, or the probe times another
function: through PyTorch's math attention in float64 it must equal the reference's compressed branch."""

import pytest
import torch
import torch.nn.functional as F

from bench.probe_cmp_fold import fold_queries, repeat_tokens, unfold_output
from nsa_model.config import NSAConfig
from nsa_model.ops import torch_impl


@pytest.mark.parametrize("B,T,H,G,D", [(2, 100, 12, 2, 16), (1, 95, 6, 3, 8), (1, 64, 4, 1, 8), (1, 32, 4, 2, 8),
                                       (1, 47, 4, 2, 8)])
@pytest.mark.parametrize("l,d", [(32, 16), (16, 8), (24, 8)])
def test_folded_causal_attention_is_the_compressed_branch(B, T, H, G, D, l, d):
    cfg = NSAConfig(cmp_block=l, cmp_stride=d)
    Tc = (T - l) // d + 1
    gen = torch.Generator().manual_seed(T * H + l)
    q = torch.randn(B, T, H, D, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(B, Tc, G, D, dtype=torch.float64, generator=gen) for _ in range(2))
    expected, _ = torch_impl.compressed_attention(q, k, v, cfg, 0.3)
    o_f = F.scaled_dot_product_attention(fold_queries(q, l, d, Tc), repeat_tokens(k, d), repeat_tokens(v, d),
                                         is_causal=True, scale=0.3, enable_gqa=True)
    assert o_f.shape == (B, d * H, Tc, D)
    got = unfold_output(o_f, l, d, T)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
