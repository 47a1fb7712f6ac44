"""The compiled CPU attention backend: the KV store and paged attention read and write the pool
in place (no gathered copies), one call per layer for the whole mixed batch, shared-prefix groups
attended once per group."""

from __future__ import annotations

import torch

from kernels.kv_quant import FORMAT_IDS
from kernels.metadata import PagedAttentionMetadata
from kernels.cpu.layer_ops import CpuLayerOps

_EMPTY = torch.zeros(0, dtype=torch.int32)
_EMPTY_TABLE = torch.zeros(0, 0, dtype=torch.int32)


class CpuAttentionBackend:
    name = "cpu"
    supports_cascade = True
    interpreted = False
    supports_deterministic = True  # fixed-order attention and linear layers (``meta.deterministic``)
    # quantized pools (``meta.kv_format``, ``kernels.kv_quant``): the store quantizes, the attention dequantizes
    supports_quantized_kv = True

    def __init__(self, ops) -> None:
        self.ops = ops  # torch.ops.kvserve_cpu
        # fused norms, activation, rotary and linear for the layers, and the whole decoder stack
        self.layer_ops = CpuLayerOps(ops, self.metadata_args)
        self._attend = ops.paged_attention.default

    def metadata_args(self, meta: PagedAttentionMetadata) -> tuple[torch.Tensor, ...]:
        """The step's metadata as the compiled ops take it (after query, K/V and the pools)."""
        groups = meta.cascade
        if groups is None:
            return (meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens, _EMPTY, _EMPTY_TABLE,
                    _EMPTY, _EMPTY, _EMPTY)
        return (meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens, groups.kv_starts,
                groups.block_tables, groups.lens, groups.member_start, groups.members)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: PagedAttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        return self._attend(query, key, value, k_pool, v_pool, *self.metadata_args(meta), scale, meta.deterministic,
                            window, softcap, FORMAT_IDS[meta.kv_format])
