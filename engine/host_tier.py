"""The host-memory KV tier, scheduler side: which chained block hash lives in which tier slot.

Every rank holds a host buffer of ``num_slots`` blocks shaped like its pool's blocks (its own shard);
this index, in the scheduler, decides what the buffers hold. A full block the pool evicts is copied
out (an offload: pool block -> slot) unless its hash is already here; a prefix lookup that misses
the pool continues here, and a hit is copied back into a fresh pool block (a restore: slot -> pool
block) before the forward that reads it. The ranks run a step's offloads first (the evicted block
may be rewritten in that very step), then its restores.

Entries are kept least recently used first; a full tier drops its least recently used entry to
make room. A slot with a copy not yet run by the ranks (an offload writing it, a restore reading
it) is pinned: never dropped or rewritten until the step that carries the copy has run, so no slot
ever takes two copies in one step. The stored token ids guard against hash collisions, as in the
pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_hash import BlockHash


@dataclass(frozen=True)
class TierEntry:
    slot: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class HostTierIndex:
    """LRU index of the tier: block hash -> ``TierEntry``, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._pinned: set[int] = set()
        self.num_evictions = 0  # entries dropped to make room
        # called with the hash of an entry that leaves (dropped to make room, or removed; not on clear)
        self.on_drop: Callable[[BlockHash], None] | None = None

    # --- read-only views (stats, the router's report, the KV map) --------------------------------

    @property
    def num_resident(self) -> int:
        return len(self._entries)

    @property
    def usage(self) -> float:
        return len(self._entries) / self.num_slots

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def resident(self) -> list[TierEntry]:
        """Every entry, most recently used first."""
        return list(reversed(self._entries.values()))

    def hashes_by_recency(self, limit: int) -> list[BlockHash]:
        """Up to ``limit`` resident hashes, most recently used first."""
        out = []
        for block_hash in reversed(self._entries):
            if len(out) >= limit:
                break
            out.append(block_hash)
        return out

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pinned

    # --- changes ------------------------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> TierEntry | None:
        """The entry holding these tokens under ``block_hash`` (made the most recently used), or None."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids:
            return None
        self._entries.move_to_end(block_hash)
        return entry

    def insert(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> TierEntry | None:
        """A slot for a new entry (the most recently used), dropping the least recently used entry
        whose slot is not pinned if none is free. None when the hash is already here, or when every
        slot is pinned."""
        if block_hash in self._entries:
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, e in self._entries.items() if e.slot not in self._pinned), None)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            self.num_evictions += 1
            if self.on_drop is not None:
                self.on_drop(victim)
        entry = self._entries[block_hash] = TierEntry(slot, block_hash, token_ids)
        return entry

    def remove(self, entry: TierEntry) -> bool:
        """Forget ``entry`` if it is still resident (its copy did not run); frees its slot."""
        if self._entries.get(entry.block_hash) != entry:
            return False
        del self._entries[entry.block_hash]
        self._pinned.discard(entry.slot)
        self._free_slots.append(entry.slot)
        if self.on_drop is not None:
            self.on_drop(entry.block_hash)
        return True

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin(self, slot: int) -> None:
        self._pinned.discard(slot)

    def clear(self) -> None:
        """Forget everything (the ranks' buffers were replaced, or the prefix cache was reset)."""
        self._entries.clear()
        self._pinned.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
