"""Torch ops of kvserve: paged attention (plain torch, and compiled CPU kernels), the KV store,
rotary embedding and norms.

``kernels.metadata`` holds the step metadata, ``kernels.attention`` the one dispatch point; ``kernels.backends``
chooses a backend; ``kernels.reference`` holds the naive versions the tests compare against. This
package imports nothing else of the project.
"""

from kernels.attention import paged_attention
from kernels.metadata import AttentionBackend, CascadeGroups, PagedAttentionMetadata
from kernels.backends import BACKENDS, select_backend
from kernels.norms import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_emb
from kernels.torch_attention import store_kv

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "CascadeGroups",
    "PagedAttentionMetadata",
    "apply_rotary_emb",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "select_backend",
    "store_kv",
]
