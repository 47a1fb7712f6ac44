"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing."""

from __future__ import annotations

from engine.block_pool import BlockPool, KVCacheBlock
from engine.request import Request


class KVCacheManager:
    """Owns ``req_to_blocks``: request id -> its block table (block i holds tokens
    [i * block_size, (i + 1) * block_size)). Every block in a table holds one reference."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already in the map
        # blocks this step's plan entered into the prefix cache: their KV exists once the step has run
        self._step_cached: list[KVCacheBlock] = []

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes ``request``, and its length in tokens.

        The hit stops one token short of the request so that the last token is always computed
        (its logits are needed to sample).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.block_pool.get_cached_block(block_hash, request.block_token_ids(i))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_forkable_blocks(self, request: Request, source: Request) -> tuple[list[KVCacheBlock], int]:
        """Full prompt blocks of ``source`` (a sibling with the same prompt, already computed) that
        ``request`` can share, stopping one token short of the prompt like a prefix hit."""
        num_blocks = min((request.num_tokens - 1) // self.block_size,
                         source.num_computed_tokens // self.block_size)
        return self.req_to_blocks[source.request_id][:num_blocks], num_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` after its computed ones.

        ``new_computed_blocks`` (a prefix hit or a fork, covering ``num_new_computed_tokens``) join the
        table first. Returns the newly allocated blocks, or None, changing nothing, when the pool is
        short. Blocks that become full with this step's tokens enter the prefix cache at once: the
        step stores their KV before any request of the step reads it.
        """
        new_computed_blocks = new_computed_blocks or []
        table = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(num_required - len(table) - len(new_computed_blocks), 0)
        # shared blocks with no other holder sit in the free queue; touching them takes them out
        num_reclaimed = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_reclaimed:
            if not table:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        table.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, table, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, table: list[KVCacheBlock], num_tokens: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            if self.block_pool.cache_block(table[i], request.block_hashes[i], request.block_token_ids(i)):
                self._step_cached.append(table[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def begin_step(self) -> None:
        """A new step is being planned: the blocks the last one cached are computed now."""
        self._step_cached.clear()

    def rollback_step(self) -> None:
        """The step being planned did not run: forget every block it entered into the prefix cache
        (their KV was never written), so no later request can hit them."""
        for block in self._step_cached:
            self.block_pool.uncache_block(block)
        self._step_cached.clear()

    def uncompute(self, request: Request) -> None:
        """``request`` computed fewer tokens than planned: re-enter the blocks past its computed ones
        into the prefix cache when it computes them again."""
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = min(
                self._num_cached_blocks[request.request_id], request.num_computed_tokens // self.block_size)

    def free(self, request: Request) -> None:
        """Release every block of ``request``, tail first (its tail is then the first evicted)."""
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def cached_hash_digest(self, limit: int) -> bytes:
        """Up to ``limit`` cached block hashes, most recently used first, 8 bytes each, concatenated."""
        return b"".join(h[:8] for h in self.block_pool.hashes_by_recency(limit))
