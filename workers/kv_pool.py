"""This rank's shard of the paged KV pool: one (k_pool, v_pool) pair per page layer (``num_layers``
here is ``KVLayout.page_layers``: every model layer for a plain layout, the full-attention layers for
a hybrid one, whose window layers share those pairs through their own tables), each [num_blocks,
block_size, num_kv_heads_per_rank, head_dim], carved from one allocation; and this rank's shard of the
host KV tier (``HostKVTier``, plain layouts only), when there is one. A quantized pool
(``kv_cache_dtype``, ``kernels.kv_quant``) is uint8 with ``head_dim + 2`` bytes per row (the codes, then
the row's bfloat16 scale): the host tier holds the same bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_quant import pool_dtype_and_width, row_bytes
from workers.allocator import HUGE_PAGE_MIN_RATE, prefault_in_background, zeroed_mapping


@dataclass(frozen=True)
class KVPoolSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_heads_replicated: bool = False  # tp > the model's KV heads: ranks hold copies of a head
    kv_format: str = "auto"  # the model's dtype, or a quantized format (``kernels.kv_quant``)

    @property
    def bytes_per_block(self) -> int:
        row = row_bytes(self.kv_format, self.head_dim, self.dtype)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row

    @property
    def pool_dtype(self) -> torch.dtype:
        return pool_dtype_and_width(self.kv_format, self.head_dim, self.dtype)[0]

    @property
    def row_width(self) -> int:
        """The pool's last dimension: head_dim, or head_dim + 2 bytes when quantized."""
        return pool_dtype_and_width(self.kv_format, self.head_dim, self.dtype)[1]

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


def allocate_kv_pool(spec: KVPoolSpec, num_blocks: int, device: torch.device, *,
                     prefault: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled pools (zeros, not garbage: masked attention still multiplies the null block); on CPU
    fresh anonymous memory, backed by huge pages where the kernel allows, its pages mapped by a
    background thread with ``prefault`` (``workers.allocator``), which keeps huge pages only while they
    map fast."""
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    if device.type == "cpu":
        pool = zeroed_mapping(shape, spec.pool_dtype)
        if prefault:  # block-id order across the layers' parts: as the pool hands blocks out
            prefault_in_background(pool, regions=spec.num_layers * 2, min_huge_rate=HUGE_PAGE_MIN_RATE)
    else:
        pool = torch.zeros(shape, dtype=spec.pool_dtype, device=device)
    return [(pool[layer, 0], pool[layer, 1]) for layer in range(spec.num_layers)]


class HostKVTier:
    """This rank's shard of the host KV tier: ``num_slots`` blocks shaped like the pool's, in host
    memory (pinned on CUDA), [num_layers, 2, num_slots, block_size, num_kv_heads, row_width]. The
    scheduler's index (``engine.host_tier``) decides which slot holds what; this only copies.
    Copies are plain (synchronous) ones, layer by layer, all blocks of a step at once."""

    def __init__(self, spec: KVPoolSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.device = device
        shape = (spec.num_layers, 2, num_slots, spec.block_size, spec.num_kv_heads, spec.row_width)
        # never read before written: no need to zero (pages are touched as slots fill)
        self.buffer = torch.empty(shape, dtype=spec.pool_dtype, pin_memory=device.type == "cuda")

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _indices(self, block_ids: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if max(slots) >= self.num_slots or min(slots) < 0:
            raise IndexError(f"host KV tier slot out of range [0, {self.num_slots})")
        return (torch.tensor(block_ids, dtype=torch.long, device=self.device),
                torch.tensor(slots, dtype=torch.long))

    def offload(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
        """(pool block, slot) pairs: the blocks' K/V of every layer into the slots."""
        if not copies:
            return
        blocks, slots = self._indices([b for b, _ in copies], [s for _, s in copies])
        for layer, (k, v) in enumerate(kv_caches):
            self.buffer[layer, 0].index_copy_(0, slots, k.index_select(0, blocks).to("cpu"))
            self.buffer[layer, 1].index_copy_(0, slots, v.index_select(0, blocks).to("cpu"))

    def restore(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
        """(slot, pool block) pairs: the slots' K/V of every layer into the pool blocks."""
        if not copies:
            return
        blocks, slots = self._indices([b for _, b in copies], [s for s, _ in copies])
        for layer, (k, v) in enumerate(kv_caches):
            k.index_copy_(0, blocks, self.buffer[layer, 0].index_select(0, slots).to(self.device))
            v.index_copy_(0, blocks, self.buffer[layer, 1].index_select(0, slots).to(self.device))
