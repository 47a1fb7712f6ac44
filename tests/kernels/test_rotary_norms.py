"""Rotary embedding and RMSNorm against from-scratch references."""

from __future__ import annotations

import pytest
import torch

from kernels import apply_rotary_emb, fused_add_rms_norm, rms_norm
from kernels.reference import naive_rms_norm, naive_rotary


def _cache(base: float, rotary_dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_matches_naive(rotary_dim):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 32, generator=gen)
    k = torch.randn(9, 2, 32, generator=gen)
    positions = torch.tensor([0, 1, 2, 7, 100, 513, 3, 3, 2047])
    q_out, k_out = apply_rotary_emb(q, k, positions, _cache(10000.0, rotary_dim, 2048))
    torch.testing.assert_close(q_out, naive_rotary(q, positions, 10000.0, rotary_dim), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, naive_rotary(k, positions, 10000.0, rotary_dim), atol=2e-4, rtol=1e-4)
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity


def test_rotary_interleaved_is_a_permutation_of_neox():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 8, generator=gen)
    positions = torch.arange(5)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved -> halves
    cache = _cache(10000.0, 8, 16)
    q_gptj, _ = apply_rotary_emb(q, q, positions, cache, is_neox=False)
    q_neox, _ = apply_rotary_emb(q[..., perm], q[..., perm], positions, cache, is_neox=True)
    torch.testing.assert_close(q_gptj[..., perm], q_neox)


def test_rms_norm_and_fused_add():
    gen = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(6, 48, generator=gen), torch.randn(6, 48, generator=gen), torch.randn(48, generator=gen)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), naive_rms_norm(x, w, 1e-6))
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, naive_rms_norm(x + res, w, 1e-6))
    assert rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).dtype == torch.bfloat16
