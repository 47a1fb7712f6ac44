"""The torch backend's prefill attention runs SDPA on inputs a fused kernel accepts (4-D, equal heads,
no dense mask), so a GPU server's prefill does not take the math path that materialises the whole
[heads, q, context] score matrix, which the start-up memory profile would have to hold. On CPU,
torch's own flash kernel has the same 4-D requirement: with every other SDPA backend disabled, a
3-D call fails ("No available kernel"), so the prefill running at all shows the fused path is
taken. The results stay those of ``kernels.reference``."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, CausalVariant

import kernels.torch_attention as torch_attention
from kernels.reference import naive_causal_attention
from tests.kernels.test_attention import _build_step

# (prefix, chunk) per prefill: no prefix, a prefix of whole blocks, one mid-block, a one-token chunk
SPECS = [(0, 9), (16, 7), (21, 12), (40, 1), (0, 33)]


def _prefill(specs, num_heads, kv_heads, head_dim, dtype, seed=0):
    q, k, v, k_pool, v_pool, meta, full_k, full_v = _build_step(specs, num_heads, kv_heads, head_dim, 8, dtype,
                                                                seed=seed)
    scale = 1 / math.sqrt(head_dim)
    # the chunk's own K/V are in the pool before attention reads it (``TorchAttentionBackend.forward``)
    torch_attention.store_kv(k, v, k_pool, v_pool, meta.slot_mapping)
    out = torch_attention.paged_prefill_attention(q, k, v, k_pool, v_pool, meta.query_lens, meta.context_lens,
                                                  meta.block_tables, scale)
    return q, out, full_k, full_v, scale


def _assert_matches_reference(specs, q, out, full_k, full_v, scale, tol):
    start = 0
    for (_, query_len), fk, fv in zip(specs, full_k, full_v):
        ref = naive_causal_attention(q[start:start + query_len].double(), fk.double(), fv.double(), scale)
        torch.testing.assert_close(out[start:start + query_len].double(), ref, atol=tol, rtol=tol)
        start += query_len


@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (14, 2, 32), (8, 1, 128)])
def test_prefill_matches_the_reference_through_the_cpu_flash_kernel_alone(num_heads, kv_heads, head_dim):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # the math path is off: a 3-D call raises here
        q, out, full_k, full_v, scale = _prefill(SPECS, num_heads, kv_heads, head_dim, torch.float32)
    _assert_matches_reference(SPECS, q, out, full_k, full_v, scale, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_stays_close_to_the_reference(dtype):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        q, out, full_k, full_v, scale = _prefill(SPECS, 8, 2, 64, dtype, seed=3)
    # the reference in float64 over the same (rounded) inputs; the kernel accumulates in float32 and
    # rounds its probabilities and output: measured at most 0.008 (bfloat16) and 0.0009 (float16)
    _assert_matches_reference(SPECS, q, out, full_k, full_v, scale, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_every_prefill_sdpa_call_is_eligible_for_the_cuda_fused_kernels(monkeypatch):
    """What CUDA's flash and memory-efficient kernels need, checked on the calls themselves: 4-D
    q/k/v, as many K/V heads as query heads (the efficient kernel has no grouped-query support), and
    no dense mask (flash takes none): ``is_causal`` without a prefix, the lower-right ``CausalBias``
    (dispatched to flash, or to the efficient kernel's own causal mask) after one."""
    calls = []

    def spy(query, key, value, attn_mask=None, is_causal=False, scale=None, **kwargs):
        calls.append((query.shape, key.shape, value.shape, attn_mask, is_causal, kwargs))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, **kwargs)

    monkeypatch.setattr(torch_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    q, out, full_k, full_v, scale = _prefill(SPECS, 8, 2, 32, torch.float32)
    _assert_matches_reference(SPECS, q, out, full_k, full_v, scale, 1e-5)
    assert len(calls) == len(SPECS)
    for (prefix, chunk), (q_shape, k_shape, v_shape, mask, is_causal, kwargs) in zip(SPECS, calls):
        assert q_shape == (1, 8, chunk, 32) and k_shape == v_shape == (1, 8, prefix + chunk, 32)
        assert not kwargs.get("enable_gqa", False)
        if prefix == 0:
            assert is_causal and mask is None
        else:
            assert not is_causal and isinstance(mask, CausalBias)
            assert (mask.variant, mask.seq_len_q, mask.seq_len_kv) == (CausalVariant.LOWER_RIGHT, chunk,
                                                                        prefix + chunk)
