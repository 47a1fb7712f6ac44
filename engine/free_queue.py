"""The free KV blocks of the pool (``engine.block_pool``), in the order they are handed out, and the
block objects themselves: ``KVCacheBlock`` (made when its id is first handed out), ``FreshBlock`` (a
stand-in for a never-used id when the queue is listed) and the queue, ``FreeKVCacheBlockQueue``.
Which block goes where, and why, is the pool's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.block_hash import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` KV slots (on every rank and layer at once)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free", "is_null",
                 "window_pages", "holds", "owner")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # collision guard for cache hits
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False
        self.window_pages: list[KVCacheBlock] | None = None  # hybrid layout: its G window pages, if attached
        self.holds = 0  # requests holding those pages
        self.owner: KVCacheBlock | None = None  # on a window page: the block it is attached to

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreshBlock:
    """Stands for a fresh free block when the free queue is listed: the id, free and uncached. It is
    not the block (that is made when the id is handed out) and the pool takes no action on it."""

    __slots__ = ("block_id",)
    ref_cnt = 0
    block_hash = token_ids = None
    prev_free = next_free = None  # so that taking it out of the free queue is refused
    is_null = False
    window_pages = owner = None
    holds = 0

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id

    def __repr__(self) -> str:
        return f"FreshBlock({self.block_id})"


class _Chain:
    """An intrusive doubly linked list of free blocks (their ``prev_free`` / ``next_free``) between two
    sentinels: O(1) push at either end, pop at the head, and unlink from anywhere (``unlink``, which
    needs only the block)."""

    __slots__ = ("head", "tail")

    def __init__(self) -> None:
        self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head

    def __bool__(self) -> bool:
        return self.head.next_free is not self.tail

    def push_front(self, block: KVCacheBlock) -> None:
        _link(self.head, block, self.head.next_free)

    def push_back(self, block: KVCacheBlock) -> None:
        _link(self.tail.prev_free, block, self.tail)

    def pop_front(self) -> KVCacheBlock:
        block = self.head.next_free
        unlink(block)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __reversed__(self) -> Iterator[KVCacheBlock]:
        block = self.tail.prev_free
        while block is not self.head:
            yield block
            block = block.prev_free


def _link(prev: KVCacheBlock, block: KVCacheBlock, nxt: KVCacheBlock) -> None:
    prev.next_free, block.prev_free = block, prev
    block.next_free, nxt.prev_free = nxt, block


def unlink(block: KVCacheBlock) -> None:
    """Take a block out of the chain it is in."""
    prev, nxt = block.prev_free, block.next_free
    if prev is None or nxt is None:
        raise RuntimeError(f"{block} is not in the free queue")
    prev.next_free, nxt.prev_free = nxt, prev
    block.prev_free = block.next_free = None


class FreeKVCacheBlockQueue:
    """The free blocks in hand-out order: a chain of blank blocks (freed without a hash; pushed and
    popped at its head), a range of fresh ids, then a chain of cached blocks (appended at its tail,
    popped at its head). Any free block leaves either chain in O(1) (``remove``).

    ``made`` lists the blocks made so far, by id (ids 0 .. len(made)-1); ids len(made) .. num_blocks-1
    are fresh. Handing out a fresh id makes its block and appends it to ``made``."""

    def __init__(self, made: list[KVCacheBlock], num_blocks: int) -> None:
        self._made = made
        self._fresh_next = len(made)  # the first fresh id (== len(made) at all times)
        self._end = num_blocks
        self._blank, self._cached = _Chain(), _Chain()
        self.num_free_blocks = num_blocks - len(made)

    @property
    def num_fresh_blocks(self) -> int:
        return self._end - self._fresh_next

    def popleft(self) -> KVCacheBlock:
        if not self.num_free_blocks:
            raise ValueError("no free KV blocks")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks at the head, taken out of the queue (fresh ones made now)."""
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"asked for {n} KV blocks with {self.num_free_blocks} free")
        self.num_free_blocks -= n
        blocks: list[KVCacheBlock] = []
        blank = self._blank
        while n and blank:
            blocks.append(blank.pop_front())
            n -= 1
        if n and self._fresh_next < self._end:
            fresh = self._make_fresh(n)
            blocks += fresh
            n -= len(fresh)
        cached = self._cached
        for _ in range(n):
            blocks.append(cached.pop_front())
        return blocks

    def _make_fresh(self, n: int) -> list[KVCacheBlock]:
        """Up to ``n`` fresh ids from the head, made into blocks."""
        start = self._fresh_next
        self._fresh_next = stop = min(start + n, self._end)
        if stop - start == 1:  # the common case of a decode step: no comprehension to set up
            block = KVCacheBlock(start)
            self._made.append(block)
            return [block]
        blocks = [KVCacheBlock(i) for i in range(start, stop)]
        self._made.extend(blocks)
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        unlink(block)
        self.num_free_blocks -= 1

    def requeue(self, block: KVCacheBlock) -> None:
        """A free block whose hash or window-page owner changed takes the place that now fits it."""
        if block.prev_free is not None:
            self.remove(block)
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        """A block joins the free queue: at the head where it is blank (no hash, and not a window page
        that follows a cached block), else at the tail (the most recently freed of the cached)."""
        if block.block_hash is None and block.owner is None:
            self._blank.push_front(block)
        else:
            self._cached.push_back(block)
        self.num_free_blocks += 1

    def blank_all(self) -> None:
        """Every cached block (hashes forgotten: a reset) joins the blank chain's end, in its order:
        the made blocks are handed out before the fresh ids, in the order they stood."""
        cached, blank = self._cached, self._blank
        while cached:
            blank.push_back(cached.pop_front())

    def blank_blocks(self) -> Iterator[KVCacheBlock]:
        """The blank blocks (the head of the queue), in hand-out order."""
        return iter(self._blank)

    def __iter__(self) -> Iterator[KVCacheBlock | FreshBlock]:
        """Every free block in hand-out order: the blank blocks, FreshBlock stand-ins for the fresh
        ids, then the cached blocks."""
        yield from self._blank
        for block_id in range(self._fresh_next, self._end):
            yield FreshBlock(block_id)
        yield from self._cached

    def __reversed__(self) -> Iterator[KVCacheBlock | FreshBlock]:
        """The hand-out order backwards: the most recently freed cached block first."""
        yield from reversed(self._cached)
        for block_id in range(self._end - 1, self._fresh_next - 1, -1):
            yield FreshBlock(block_id)
        yield from reversed(self._blank)
