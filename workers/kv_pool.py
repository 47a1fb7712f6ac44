"""This rank's shard of the paged KV pool: one (k_pool, v_pool) pair per layer, each
[num_blocks, block_size, num_kv_heads_per_rank, head_dim], carved from one allocation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.allocator import huge_empty


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_heads_replicated: bool = False  # tp > the model's KV heads: ranks hold copies of a head

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


def allocate_kv_pool(spec: KVPoolSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled pools (zeros, not garbage: masked attention still multiplies the null block); on CPU
    backed by huge pages where the kernel allows (``workers.allocator``)."""
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        pool = huge_empty(shape, spec.dtype).zero_()
    else:
        pool = torch.zeros(shape, dtype=spec.dtype, device=device)
    return [(pool[layer, 0], pool[layer, 1]) for layer in range(spec.num_layers)]
