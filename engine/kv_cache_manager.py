"""Per-request block tables on top of the block pool: prefix hits, slot allocation, freeing; and,
with a host tier, which evicted blocks are copied out and which tier hits are copied back; with a
hybrid KV layout, the window pages each request holds (``engine/window_kv.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVCacheBlock
from engine.host_tier import HostTierIndex, TierEntry
from engine.kv_layout import KVLayout
from engine.metrics import HostTierStats
from engine.request import Request
from engine.window_kv import WindowHolds


@dataclass(frozen=True)
class TierCopy:
    """One copy between the pool and the host tier, as the scheduler recorded it (undone with its step)."""

    offload: bool  # pool -> tier; else tier -> pool (a restore)
    block: KVCacheBlock
    entry: TierEntry


class KVCacheManager(WindowHolds):
    """Owns ``req_to_blocks``: request id -> its block table (block i holds tokens
    [i * block_size, (i + 1) * block_size)). Every block in a table holds one reference. With a
    hybrid ``kv_layout`` (G window groups), each request also holds the G window pages of the blocks
    from its window on (``engine/window_kv.py``: the holds, and their invariants)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_host_blocks: int = 0,
                 host_block_bytes: int = 0, kv_layout: KVLayout | None = None) -> None:
        self.block_size = block_size
        self._init_windows(kv_layout)
        if self.num_window_groups and num_host_blocks:
            raise ValueError("the host KV tier keeps every layer's blocks whole: it needs a plain KV layout")
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already in the map
        # blocks this step's plan entered into the prefix cache: their KV exists once the step has run
        self._step_cached: list[KVCacheBlock] = []
        # the host tier (None when off): its index, the copies recorded but not yet sent to the ranks
        # (a step with no tokens is not sent; they go with the next), and those of the step in flight
        self.host_tier = HostTierIndex(num_host_blocks) if num_host_blocks and enable_caching else None
        self.host_block_bytes = host_block_bytes  # one block over every rank
        self.tier_stats = HostTierStats()
        self._pending_copies: list[TierCopy] = []
        self._sent_copies: list[TierCopy] = []
        self._restoring: set[int] = set()  # pool blocks a pending restore will fill
        # the plan being made, while ``Scheduler.schedule`` runs (engine.plan_undo.PlanUndo): it
        # records the cached blocks the pool hands out, so that a plan that raises gives their hash back
        self.plan = None
        if self.host_tier is not None:
            self.block_pool.on_evict = self._offload
            # a hash only the tier holds stays in the routing report until the tier drops it
            self.block_pool.held_elsewhere = self.host_tier.__contains__
            self.host_tier.on_drop = self.block_pool.forget_elsewhere

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
        if self.host_tier is not None and len(hits) < max_blocks:
            hits = self._continue_in_tier(request, hits, max_blocks)
        if self.num_window_groups:
            del hits[self._window_chain(hits):]
        return hits, len(hits) * self.block_size

    # --- the host tier ----------------------------------------------------------------------------

    def _continue_in_tier(self, request: Request, hits: list[KVCacheBlock], max_blocks: int) -> list[KVCacheBlock]:
        """Extend a prefix hit past the pool: block by block, the pool first, then the tier, whose hit
        is restored into a fresh pool block that enters the prefix cache at once (its copy runs
        before the next forward). The chain is held while it grows, so the blocks taken for the
        restores never evict a block of it; then it is released tail first, as a request frees.
        Restores stop where the free blocks could not hold the rest of the request: a request that
        cannot be scheduled would only churn the pool (and its restored blocks could be evicted
        before it runs)."""
        pool, tier = self.block_pool, self.host_tier
        num_blocks = -(-request.num_tokens // self.block_size)
        pool.touch(hits)
        try:
            for i in range(len(hits), max_blocks):
                block_hash, token_ids = request.block_hashes[i], request.block_token_ids(i)
                block = pool.get_cached_block(block_hash, token_ids)
                if block is not None:
                    pool.touch([block])
                    hits.append(block)
                    continue
                self.tier_stats.queries += 1
                entry = tier.lookup(block_hash, token_ids)
                if entry is None or pool.num_free_blocks < num_blocks - len(hits):
                    break
                tier.pin(entry.slot)  # before the eviction below, whose offload must not take this slot
                block = pool.get_new_blocks(1)[0]  # may evict (and offload) another block
                pool.cache_block(block, block_hash, token_ids)
                self._pending_copies.append(TierCopy(False, block, entry))
                self._restoring.add(block.block_id)
                self.tier_stats.hits += 1
                hits.append(block)
        finally:
            pool.free_blocks(reversed(hits))
        return hits

    def begin_plan(self, plan) -> None:
        """A step is being planned: ``plan`` (a PlanUndo) hears of every cached block handed out."""
        self.plan = plan
        self.block_pool.on_evict = self._on_evict
        if self.num_window_groups:
            self.block_pool.begin_deferring()

    def end_plan(self) -> None:
        self.plan = None
        if self.num_window_groups:
            self.block_pool.end_deferring()
        self.block_pool.on_evict = self._offload if self.host_tier is not None else None

    def _on_evict(self, block: KVCacheBlock) -> None:
        self.plan.evicted(block)
        if self.host_tier is not None:
            self._offload(block)

    def _offload(self, block: KVCacheBlock) -> None:
        """The pool is about to evict ``block`` (cached, so full and computed): copy it out unless the
        tier already holds it, another pool block holds the same, or a restore into it is pending."""
        block_hash: BlockHash = block.block_hash
        if (len(self.block_pool.cached.get(block_hash, ())) > 1 or block.block_id in self._restoring
                or block_hash in self.host_tier):
            return
        entry = self.host_tier.insert(block_hash, block.token_ids)
        if entry is None:
            return  # every slot has a copy in flight
        self.host_tier.pin(entry.slot)
        self._pending_copies.append(TierCopy(True, block, entry))
        self.tier_stats.offloaded += 1

    def take_tier_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the step being sent must run before its forward: (pool block, slot) offloads,
        then (slot, pool block) restores. They count as in flight until the next step is planned."""
        copies, self._pending_copies = self._pending_copies, []
        self._sent_copies.extend(copies)
        self._restoring.clear()
        return ([(c.block.block_id, c.entry.slot) for c in copies if c.offload],
                [(c.entry.slot, c.block.block_id) for c in copies if not c.offload])

    def _settle_sent_copies(self) -> None:
        for copy in self._sent_copies:
            self.host_tier.unpin(copy.entry.slot)
        self._sent_copies.clear()

    def _undo_sent_copies(self) -> None:
        """The step that carried these copies did not run (or not whole): tier entries it was to
        write are forgotten, pool blocks it was to fill leave the prefix cache."""
        for copy in reversed(self._sent_copies):
            if copy.offload:
                if self.host_tier.remove(copy.entry):
                    self.tier_stats.offloaded -= 1
            else:
                self.host_tier.unpin(copy.entry.slot)
                self.tier_stats.hits -= 1
                if copy.block.block_hash == copy.entry.block_hash:
                    self.block_pool.uncache_block(copy.block)
        self._sent_copies.clear()

    def host_tier_stats(self) -> dict:
        """The tier's ``stats()`` keys (zeros and an empty tier when there is none)."""
        tier = self.host_tier
        return self.tier_stats.as_stats(self.block_size, self.host_block_bytes,
                                        tier.num_slots if tier else 0, tier.num_resident if tier else 0,
                                        tier.num_evictions if tier else 0)

    def get_forkable_blocks(self, request: Request, source: Request) -> tuple[list[KVCacheBlock], int]:
        """Full prompt blocks of ``source`` (a sibling with the same prompt, already computed) that
        ``request`` can share, stopping one token short of the prompt like a prefix hit."""
        num_blocks = min((request.num_tokens - 1) // self.block_size,
                         source.num_computed_tokens // self.block_size)
        blocks = self.req_to_blocks[source.request_id][:num_blocks]
        if self.num_window_groups:
            del blocks[self._window_chain(blocks):]
        return blocks, len(blocks) * self.block_size

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
        short. With G window groups a new block takes 1 + G pages, and the joined blocks from
        ``first_needed(num_computed)`` on are held (``engine/window_kv.py``). Blocks that become full
        with this step's tokens enter the prefix cache at once: the step stores their KV before any
        request of the step reads it.
        """
        new_computed_blocks = new_computed_blocks or []
        table = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(num_required - len(table) - len(new_computed_blocks), 0)
        # shared blocks with no other holder sit in the free queue; touching them takes them out
        num_reclaimed = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        groups, num_pages, held = self.num_window_groups, num_new_blocks, ()
        if groups:
            start = self._win_start.get(request.request_id)
            if start is None:
                start = self.first_needed(num_computed)
            held = new_computed_blocks[max(start - len(table), 0):]
            # the pages of held blocks nobody else holds sit in the free queue too
            num_reclaimed += groups * sum(1 for block in held if not block.holds)
            num_pages += groups * num_new_blocks
        if num_pages > self.block_pool.num_free_blocks - num_reclaimed:
            if not table:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        for block in held:  # their pages out of the free queue before any block is handed out
            self.block_pool.hold(block)
        table.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_pages)
        if groups:
            pages, new_blocks = new_blocks[num_new_blocks:], new_blocks[:num_new_blocks]
            for i, block in enumerate(new_blocks):
                self.block_pool.attach(block, pages[i * groups:(i + 1) * groups])
            self._win_start[request.request_id] = start
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
        self.block_pool.refresh(table[start:end])  # in the routing report, the chain's head most recent
        self._num_cached_blocks[request.request_id] = max(start, end)

    def begin_step(self) -> None:
        """A new step is being planned: the blocks the last one cached are computed now (and the
        tier copies it carried have run)."""
        self._step_cached.clear()
        if self.host_tier is not None:
            self._settle_sent_copies()

    def rollback_step(self) -> None:
        """The step being planned did not run: forget every block it entered into the prefix cache
        (their KV was never written), so no later request can hit them; and the tier copies it
        carried (an entry it was to write, a block it was to restore)."""
        for block in self._step_cached:
            self.block_pool.uncache_block(block)
        self._step_cached.clear()
        if self.host_tier is not None:
            self._undo_sent_copies()

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
        if self.num_window_groups:
            self._drop_holds(request.request_id, table)
        self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, the host tier's index with it (refused while blocks are in use)."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.clear()
            self._pending_copies.clear()
            self._sent_copies.clear()
            self._restoring.clear()
        return True

    def cached_hash_digest(self, limit: int) -> bytes:
        """Up to ``limit`` of the routing report's hashes (the pool's, and those only the host tier
        holds: ``engine/prefix_report.py``), most recently used first, 8 bytes each, concatenated."""
        return b"".join(h[:8] for h in self.block_pool.hashes_by_recency(limit))
