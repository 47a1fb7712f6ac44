"""Torch ops of kvserve: paged attention, the KV store, rotary embedding and norms.

Every op here is plain torch, so the same code runs on CPU and CUDA; ``kernels.reference`` holds
the naive versions the tests compare against. This package imports nothing else of the project.
"""

from kernels.attention import (
    PagedAttentionMetadata,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from kernels.norms import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_emb

__all__ = [
    "PagedAttentionMetadata",
    "apply_rotary_emb",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "store_kv",
]
