"""RoPE against its definition in float64: pairs (i, i + D/2) turned by t * theta^(-2i/D); relative positions."""

from __future__ import annotations

import math

import pytest
import torch

from nsa_model.rope import RotaryEmbedding


def rotated_by_definition(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Each pair (x_i, x_{i+D/2}) at position t turned by the angle t * theta^(-2i/D), one scalar at a time."""
    B, T, H, D = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(T):
        for i in range(D // 2):
            a = t * theta ** (-2.0 * i / D)
            x1, x2 = x[:, t, :, i].double(), x[:, t, :, i + D // 2].double()
            out[:, t, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[:, t, :, i + D // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-6), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rope_matches_the_pairwise_rotation(dtype, tol):
    """The tables are float32, so the float64 path agrees to float32 precision; bf16 comes back in bf16."""
    torch.manual_seed(0)
    x = torch.randn(2, 37, 3, 16).to(dtype)
    rope = RotaryEmbedding(16, max_seq_len=64, theta=10000.0)
    out = rope(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rotated_by_definition(x, 10000.0), atol=tol, rtol=tol)


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(1)
    rope = RotaryEmbedding(8, max_seq_len=64, theta=100.0)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    seq_q, seq_k = q.expand(1, 64, 1, 8), k.expand(1, 64, 1, 8)
    rq, rk = rope(seq_q)[0, :, 0], rope(seq_k)[0, :, 0]
    scores = rq @ rk.T  # [t, s]
    for shift in (1, 5, 20):
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift], atol=1e-5, rtol=0)
    assert not torch.allclose(scores[10, 3], scores[10, 4])  # and they do depend on it


def test_rope_gradient_is_the_inverse_rotation():
    """The backward of a rotation is the rotation by minus the angle: rotating the gradient back must give it."""
    torch.manual_seed(2)
    rope = RotaryEmbedding(16, max_seq_len=32, theta=10000.0)
    x = torch.randn(2, 32, 2, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 32, 2, 16, dtype=torch.float64)
    rope(x).backward(g)
    torch.testing.assert_close(rope(x.grad), g, atol=1e-6, rtol=1e-6)


def test_rope_refuses_sequences_past_its_tables():
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        RotaryEmbedding(4, max_seq_len=8, theta=10.0)(torch.zeros(1, 9, 1, 4))
