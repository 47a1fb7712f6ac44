"""The prefix cache's routing report, kept incrementally: which block hashes a router is told about,
and what changed since a reader last asked.

A router matches a prompt's chain of block hashes against each replica's report (``cluster/router.py``:
a set, the order carries nothing). The report is bounded: it names at most ``limit`` distinct hashes
the engine holds (in its pool, or only in its host KV tier), those most recently used. A hash is
*used* when a block holding it enters the prefix cache, is hit (taken by another request) or is
released; a chain is refreshed tail first, so its first block is the most recent and the limit
shortens a chain rather than beheading it. The set is an LRU of ``limit`` hashes over those uses:
a hash also leaves it when nothing holds it any more (no pool block, no tier entry), and its place
stays empty until another hash is used (the pool evicts the least recently freed blocks first, so
a hash in the set is rarely the one to go while older ones are held).

``RecentHashes`` (owned by the block pool, changed under the engine's lock) keeps that LRU, every
change O(1) and its memory O(``limit``). Each change of the set is appended to a bounded change
log, numbered, so a reader holding a cursor gets only what changed since (``read``): the copy taken
under the lock is a slice of the log, or, on first contact, after a reset, or when the log no
longer reaches back to the cursor, the whole set (``limit`` hashes).

``PrefixReport`` (the reporter's side, outside the lock) turns what it read into the payload a
router merges: a base (the whole set, 8-byte hashes concatenated, as of the last full read or
rebase) plus the net hashes added and removed since that base. Every payload stands alone, so a
router that missed some (Serve passes on only the latest) still sees the current set.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

from engine.block_hash import BlockHash

REPORT_LIMIT = 16384  # hashes in a routing report (8 bytes each: 128 KiB)
HASH_BYTES = 8  # a router's hashes: the engine's truncated to this many bytes
ADDED, REMOVED = 1, 0


class HashChanges(NamedTuple):
    """What ``RecentHashes.read`` hands a reader: the new cursor, and either the whole reported set
    (``full``, most recent first) or the log's entries since the reader's cursor (``hashes`` with
    their ``ops``: ADDED or REMOVED, in order)."""

    cursor: int
    full: list[BlockHash] | None
    hashes: list[BlockHash]
    ops: bytes


class RecentHashes:
    """At most ``limit`` held hashes, the most recently used (an LRU), and the log of its changes.

    Invariants: every hash of ``top`` is held; ``len(top) <= limit``; a held hash used more recently
    than one in ``top`` is in ``top``; log entry ``i`` (numbered from ``_start``) is the i-th change of
    ``top``'s membership since the last ``clear``; the log holds at most ``2 * log_limit`` entries."""

    def __init__(self, limit: int = REPORT_LIMIT, log_limit: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"the routing report needs a limit of at least 1 hash, got {limit}")
        self.limit = limit
        self.log_limit = log_limit or 2 * limit
        self.top: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self._log: list[BlockHash] = []
        self._ops = bytearray()
        self._start = 0  # the number of the log's first entry (the next entry's: _start + len(_log))

    def __len__(self) -> int:
        return len(self.top)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.top

    @property
    def log_size(self) -> int:
        return len(self._log)

    def by_recency(self) -> Iterator[BlockHash]:
        """The hashes, most recently used first."""
        return reversed(self.top)

    def use(self, block_hash: BlockHash) -> None:
        """A block holding ``block_hash`` was cached, hit or released: the hash is the most recent."""
        top = self.top
        if block_hash in top:
            top.move_to_end(block_hash)
            return
        top[block_hash] = None
        log, ops = self._log, self._ops
        log.append(block_hash)
        ops.append(ADDED)
        if len(top) > self.limit:
            oldest, _ = top.popitem(last=False)
            log.append(oldest)
            ops.append(REMOVED)
        self._logged()

    def discard(self, block_hash: BlockHash) -> None:
        """Nothing holds ``block_hash`` any more."""
        if block_hash in self.top:
            del self.top[block_hash]
            self._log.append(block_hash)
            self._ops.append(REMOVED)
            self._logged()

    def clear(self) -> None:
        """Forget every hash (the prefix cache was reset): every reader's next read is a full one."""
        self.top.clear()
        self._start += len(self._log) + 1  # past every cursor handed out
        self._log.clear()
        self._ops.clear()

    def read(self, cursor: int | None) -> HashChanges:
        """The changes since ``cursor`` (a cursor this returned before), or the whole set when the
        log does not reach back to it. Costs a copy of the changes, or of ``limit`` hashes: never a
        walk over the pool."""
        seq = self._start + len(self._log)
        if cursor is None or not self._start <= cursor <= seq:
            return HashChanges(seq, list(reversed(self.top)), [], b"")
        i = cursor - self._start
        return HashChanges(seq, None, self._log[i:], bytes(self._ops[i:]))

    def _logged(self) -> None:
        if len(self._log) > 2 * self.log_limit:  # drop the older entries (amortised O(1) per entry)
            n = len(self._log) - self.log_limit
            del self._log[:n], self._ops[:n]
            self._start += n


class PrefixReport:
    """A reporter's view of one engine's ``RecentHashes``: a cursor, a base and the net changes since.

    ``read(cursor)`` is called with ``lock`` held (the engine's): it must be the cheap
    ``RecentHashes.read``. ``payload()`` answers the router's keys: ``prefix_hashes`` (the base,
    8-byte hashes concatenated), ``prefix_added`` and ``prefix_removed`` (likewise: what changed
    since the base). Once the changes outgrow ``rebase_after`` hashes the base is rebuilt here, from
    what this reporter already has (no lock)."""

    def __init__(self, read: Callable[[int | None], HashChanges],
                 lock: AbstractContextManager | None = None, rebase_after: int = REPORT_LIMIT // 4) -> None:
        self._read = read
        self._engine_lock = lock if lock is not None else nullcontext()
        self.rebase_after = rebase_after
        self.cursor: int | None = None
        self.base: list[bytes] = []
        self._base_bytes = b""
        self.added: dict[bytes, None] = {}
        self.removed: dict[bytes, None] = {}
        self.num_full_reads = 0
        self._lock = threading.Lock()  # one reporter, possibly called from several threads

    def report(self) -> dict:
        """Read what changed (under the engine's lock), merge it, and answer the payload."""
        with self._lock:
            with self._engine_lock:
                changes = self._read(self.cursor)
            self.merge(changes)
            return self.payload()

    def merge(self, changes: HashChanges) -> None:
        self.cursor = changes.cursor
        if changes.full is not None:
            self.num_full_reads += 1
            self._set_base([h[:HASH_BYTES] for h in changes.full])
            return
        added, removed = self.added, self.removed
        for block_hash, op in zip(changes.hashes, changes.ops):
            key = block_hash[:HASH_BYTES]
            # a hash's membership alternates, so a change undoes the opposite one since the base
            undone, kept = (removed, added) if op == ADDED else (added, removed)
            if key in undone:
                del undone[key]
            else:
                kept[key] = None
        if len(added) + len(removed) > self.rebase_after:
            self._set_base([k for k in self.base if k not in removed] + list(added))

    def _set_base(self, base: list[bytes]) -> None:
        self.base, self._base_bytes = base, b"".join(base)
        self.added, self.removed = {}, {}

    def payload(self) -> dict:
        return {"prefix_hashes": self._base_bytes, "prefix_added": b"".join(self.added),
                "prefix_removed": b"".join(self.removed)}

    def hashes(self) -> set[bytes]:
        """The reported set, as this reporter holds it (8-byte hashes)."""
        return (set(self.base) - self.removed.keys()) | self.added.keys()
