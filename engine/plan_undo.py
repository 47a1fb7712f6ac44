"""Undoing a step: its plan raised (or was interrupted) before it was sent (``PlanUndo``), or it was
sent and did not run (``undo_sent_step``).

``Scheduler.schedule`` changes the scheduler, the block tables, the pool, the prefix cache and the
host tier's index as it plans. When anything raises midway (an allocation, the host tier's swap
planning, the grammar bitmask, a KeyboardInterrupt), ``PlanUndo.apply`` puts them back as they were
before the plan began: the queues in their order, every request's counters, every block table (a
preempted request gets its very blocks back: nothing ran, so their KV is intact), the free block
count, the cached hashes (entries the plan added leave; blocks it evicted get their hash back), the
tier copies it recorded and the statistics it counted (with a hybrid KV layout, the window holds:
a request it preempted whose window pages it handed out meanwhile is preempted again, for
recompute). What is not restored is order only: where freed blocks sit in the free queue, the
recency of tier entries, and a tier entry dropped to make room for an offload the plan recorded (the
tier is only a cache: that block is recomputed if needed).

It costs a copy of ``running`` (at most ``max_num_seqs``) per step, a tuple per request the plan
touches and an entry per change to the waiting queue (``PlanQueue`` logs them; the queue is not
copied, so the cost does not grow with the queue); the block tables are not copied (a plan only
appends to a table, or drops it whole), nor the queue-time histogram (the samples the plan added
are those of the requests it first scheduled).
"""

from __future__ import annotations

import bisect
from collections import deque

from engine.block_pool import KVCacheBlock
from engine.request import Request, RequestStatus

_FIELDS = ("status", "num_computed_tokens", "num_tokens_sent", "num_blocks_sent", "num_cached_tokens",
           "first_scheduled_time", "fork_source", "num_preemptions")
_STATS = ("num_preemptions", "num_prompt_tokens", "prefix_cache_queries", "prefix_cache_hits",
          "kv_peak_blocks", "kv_waste_at_peak")


class PlanQueue(deque):
    """The waiting queue. While a plan runs (``log`` set) it logs each change it makes (a plan pops
    and pushes at the head, and moves a request planned alone there) so that ``PlanUndo`` takes
    them back in reverse, without a copy of the queue."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.log: list | None = None

    def popleft(self):
        item = super().popleft()
        if self.log is not None:
            self.log.append((0, item))
        return item

    def appendleft(self, item) -> None:
        super().appendleft(item)
        if self.log is not None:
            self.log.append((1, item))

    def extendleft(self, items) -> None:
        for item in items:
            self.appendleft(item)

    def remove(self, item) -> None:
        if self.log is None:
            return super().remove(item)
        index = self.index(item)
        del self[index]
        self.log.append((2, index, item))

    def undo(self) -> None:
        """Take back the logged changes, last first, and stop logging."""
        log, self.log = self.log, None
        for entry in reversed(log or ()):
            if entry[0] == 0:
                super().appendleft(entry[1])
            elif entry[0] == 1:
                super().popleft()
            else:
                self.insert(entry[1], entry[2])


class PlanUndo:
    """What a plan changed, recorded as it goes (``touch`` before a request changes, ``evicted`` as
    the pool hands out a cached block), and how to take it back."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        kv = scheduler.kv
        self.running = list(scheduler.running)
        scheduler.waiting.log = []  # the queue logs what the plan changes (``PlanQueue``)
        self.dropped_ids = set(scheduler._dropped_ids)
        self.stats = tuple(getattr(scheduler.stats, name) for name in _STATS)
        queue_time = scheduler.stats.queue_time
        self.queue_time = (queue_time.total, queue_time.count)
        self.tier_stats = (kv.tier_stats.queries, kv.tier_stats.hits, kv.tier_stats.offloaded)
        self.pending_copies = len(kv._pending_copies)
        self.pool_evictions = kv.block_pool.num_evictions
        self._tables, self._num_cached = kv.req_to_blocks, kv._num_cached_blocks
        # request id -> (request, its fields, its table object and length, its cached-block count)
        self.touched: dict[str, tuple] = {}
        self.evictions: list[tuple[KVCacheBlock, bytes, tuple[int, ...]]] = []
        self.win_starts: dict[str, int | None] = {}  # hybrid layout: request id -> its ``kv._win_start``

    def touch(self, request: Request) -> None:
        """Record ``request`` before the plan changes it (once per plan)."""
        request_id = request.request_id
        if request_id in self.touched:
            return
        table = self._tables.get(request_id)
        r = request
        self.touched[request_id] = (
            r, (r.status, r.num_computed_tokens, r.num_tokens_sent, r.num_blocks_sent, r.num_cached_tokens,
                r.first_scheduled_time, r.fork_source, r.num_preemptions),  # as _FIELDS
            table, len(table) if table is not None else 0, self._num_cached.get(request_id))
        if self.scheduler.kv.num_window_groups:
            self.win_starts[request_id] = self.scheduler.kv._win_start.get(request_id)

    def evicted(self, block: KVCacheBlock) -> None:
        """The pool is handing out ``block``, cached: remember its contents (still on the ranks)."""
        self.evictions.append((block, block.block_hash, block.token_ids))

    @property
    def touched_ids(self) -> list[str]:
        """The requests the plan touched, in the order it did."""
        return list(self.touched)

    def apply(self) -> None:
        """Put everything back as it was before the plan."""
        scheduler = self.scheduler
        kv = scheduler.kv
        pool = kv.block_pool
        # 1. the prefix-cache entries the plan made (their KV was never written), and its tier copies
        for block in kv._step_cached:
            pool.uncache_block(block)
        kv._step_cached.clear()
        for copy in reversed(kv._pending_copies[self.pending_copies:]):
            if copy.offload:
                kv.host_tier.remove(copy.entry)
            else:
                kv.host_tier.unpin(copy.entry.slot)
                kv._restoring.discard(copy.block.block_id)
                if copy.block.block_hash == copy.entry.block_hash:
                    pool.uncache_block(copy.block)
        del kv._pending_copies[self.pending_copies:]
        kv.tier_stats.queries, kv.tier_stats.hits, kv.tier_stats.offloaded = self.tier_stats
        # 2. the blocks the plan gave out: every touched table back to its length, tail first ...
        restore, given_back = [], []
        for request_id, (request, _, table, length, num_cached) in self.touched.items():
            current = kv.req_to_blocks.get(request_id)
            if current is not None and current is not table:  # a table the plan made (or remade)
                kv.req_to_blocks.pop(request_id)
                pool.free_blocks(reversed(current))
                given_back += current
            elif current is not None and len(current) > length:
                extra = current[length:]
                del current[length:]
                pool.free_blocks(reversed(extra))
                given_back += extra
            if table is not None and current is not table:  # freed by the plan (preempted): taken back below
                restore.append((request_id, table, length, num_cached))
            elif num_cached is None:
                kv._num_cached_blocks.pop(request_id, None)
            else:
                kv._num_cached_blocks[request_id] = num_cached
        if kv.num_window_groups:  # the pages of the blocks given back (none of a table restored below)
            kv.resync_windows()
            # a block the plan handed out that nobody holds now loses the pages the plan attached to it
            # (never written) at once, not when the plan ends: a page may be a block of a table restored
            # below (the plan preempted its request, then handed the block out as a page), which the
            # resync after the restore would otherwise free again as that page (a double free)
            for block in given_back:
                if block.window_pages is not None and not block.holds and block.block_hash is None:
                    pool.detach(block)
        # ... then the blocks of the requests it preempted, the very same ones
        for request_id, table, length, num_cached in restore:
            del table[length:]
            pool.touch(table)
            kv.req_to_blocks[request_id] = table
            if num_cached is not None:
                kv._num_cached_blocks[request_id] = num_cached
        # 3. hashes the plan evicted: the blocks still hold that KV
        for block, block_hash, token_ids in reversed(self.evictions):
            if block.block_hash is None:
                if kv.num_window_groups:
                    # the plan attached pages to it, or made it a page of a block it handed out: those
                    # were never written, and a cached block's pages are its own KV
                    if block.owner is not None and not block.owner.holds:
                        pool.detach(block.owner)
                    if block.window_pages is not None and not block.holds:
                        pool.detach(block)
                pool.cache_block(block, block_hash, token_ids)
        pool.num_evictions = self.pool_evictions
        # 4. the requests, the queues and the statistics
        queue_time = scheduler.stats.queue_time
        for request, fields, *_ in self.touched.values():
            if fields[4] < 0 <= request.num_cached_tokens:  # first scheduled by the plan: its sample leaves
                waited = request.first_scheduled_time - request.arrival_time  # the value it observed
                queue_time.counts[bisect.bisect_left(queue_time.buckets, waited)] -= 1
            for name, value in zip(_FIELDS, fields):
                setattr(request, name, value)
        scheduler.running[:] = self.running
        scheduler.waiting.undo()
        scheduler._dropped_ids = self.dropped_ids
        scheduler._step_started = []
        for name, value in zip(_STATS, self.stats):
            setattr(scheduler.stats, name, value)
        queue_time.total, queue_time.count = self.queue_time
        if kv.num_window_groups:
            self._resync_windows()

    def _resync_windows(self) -> None:
        """Window holds as the restored tables say; a request the plan preempted whose window pages
        were handed out meanwhile (so lost) is preempted again, for recompute: a rare path."""
        scheduler, kv = self.scheduler, self.scheduler.kv
        for request_id, start in self.win_starts.items():
            if start is None:
                kv._win_start.pop(request_id, None)
            else:
                kv._win_start[request_id] = start
        lost = set(kv.resync_windows())
        if lost:
            scheduler._plan = None  # not the plan's: it is undone
            for request in [r for r in scheduler.running if r.request_id in lost]:
                scheduler.running.remove(request)
                scheduler._preempt(request)


def undo_sent_step(scheduler, scheduler_output) -> None:
    """The step planned as ``scheduler_output`` did not run (it raised, or was interrupted): undo
    it. Blocks it entered into the prefix cache leave it (their KV was never written); requests
    it started go back to the head of the queue, the others back to the tokens they had computed;
    every request of the step is sent to the ranks in full next time, whatever state the failure
    left there. Nothing was appended, so the requests produce the tokens they would have."""
    scheduler.kv.rollback_step()
    for request_id, n in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests.get(request_id)
        if request is not None:
            request.num_computed_tokens -= n
    started = [r for r in scheduler._step_started if r.status == RequestStatus.RUNNING]
    if started:
        ids = {r.request_id for r in started}
        scheduler.running = [r for r in scheduler.running if r.request_id not in ids]
        for request in reversed(started):
            scheduler._preempt(request, counted=False)
    scheduler._step_started = []
    for request_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests.get(request_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            scheduler.kv.uncompute(request)
            request.num_tokens_sent = request.num_blocks_sent = 0
            scheduler._dropped_ids.add(request_id)
    scheduler._dropped_ids |= scheduler_output.finished_req_ids
