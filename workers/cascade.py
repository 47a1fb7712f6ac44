"""Planning shared-prefix (cascade) attention for one step, from the step's block tables.

Sequences whose tables start with the same physical block ids share those blocks' keys (prefix-cache
hits and n > 1 forks share only full blocks). A group is a set of sequences and a number of leading
blocks they all hold, all computed before any of the members' query tokens; attention then reads
those blocks once for the whole group instead of once per member.

Every rank plans from the same tables (the scheduler's diffs), so all ranks agree without anything
more crossing process boundaries.

The partition maximises the key reads saved, ``sum over groups of (members - 1) * shared blocks``:
walking the block-id trie, a node either is one group (its members' common prefix) or hands its
members to its children (those that continue with the same next block); a sequence belongs to at
most one group. Groups below ``min_members`` sequences or ``min_shared_tokens`` are not worth a
separate pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CascadePlan:
    kv_starts: np.ndarray  # [num_seqs] int32: shared tokens of the sequence's group, 0 outside groups
    block_tables: np.ndarray  # [num_groups, max_shared_blocks] int32
    lens: np.ndarray  # [num_groups] int32 (tokens)
    member_start: np.ndarray  # [num_groups + 1] int32
    members: np.ndarray  # [num_members] int32


def _common_blocks(table: np.ndarray, members: np.ndarray, depth: int, limit: int) -> int:
    """How many leading blocks (>= depth, which they share already) all ``members`` share, up to ``limit``."""
    if limit <= depth:
        return limit
    rows = table[members, depth:limit]
    same = (rows == rows[0]).all(axis=0)
    return depth + (int(np.argmin(same)) if not same.all() else limit - depth)


def _best(table: np.ndarray, limits: np.ndarray, members: np.ndarray, depth: int,
          min_members: int, min_blocks: int) -> tuple[int, list[tuple[np.ndarray, int]]]:
    """(blocks saved, groups) of the best partition of ``members``, which share ``depth`` blocks."""
    limit = int(limits[members].min())
    shared = _common_blocks(table, members, depth, limit)
    own_saving = (len(members) - 1) * shared if len(members) >= min_members and shared >= min_blocks else 0
    deeper = members[limits[members] > shared]
    child_saving, child_groups = 0, []
    if len(deeper) >= min_members:
        next_blocks = table[deeper, shared]
        order = np.argsort(next_blocks, kind="stable")
        deeper, next_blocks = deeper[order], next_blocks[order]
        bounds = np.flatnonzero(np.diff(next_blocks)) + 1
        for child in np.split(deeper, bounds):
            if len(child) >= min_members:
                saving, groups = _best(table, limits, child, shared + 1, min_members, min_blocks)
                child_saving += saving
                child_groups += groups
    if own_saving >= child_saving and own_saving > 0:
        return own_saving, [(members, shared)]
    return child_saving, child_groups


def plan_cascade(table: np.ndarray, first_positions: np.ndarray, block_size: int, min_members: int = 2,
                 min_shared_tokens: int = 32) -> CascadePlan | None:
    """Groups for a step whose sequences have block tables ``table`` ([num_seqs, width], null-block
    padded) and whose first query tokens sit at ``first_positions`` (only the full blocks before
    that are computed and may be shared). None when no group is worth it."""
    num_seqs = table.shape[0]
    if num_seqs < min_members:
        return None
    limits = np.minimum(first_positions // block_size, table.shape[1]).astype(np.int64)
    candidates = np.flatnonzero(limits > 0)
    if len(candidates) < min_members:
        return None
    min_blocks = max(1, -(-min_shared_tokens // block_size))
    firsts = table[candidates, 0]
    order = np.argsort(firsts, kind="stable")
    candidates, firsts = candidates[order], firsts[order]
    groups: list[tuple[np.ndarray, int]] = []
    for root in np.split(candidates, np.flatnonzero(np.diff(firsts)) + 1):
        if len(root) >= min_members:
            groups += _best(table, limits, root, 1, min_members, min_blocks)[1]
    if not groups:
        return None
    width = max(shared for _, shared in groups)
    block_tables = np.zeros((len(groups), width), dtype=np.int32)
    kv_starts = np.zeros(num_seqs, dtype=np.int32)
    lens = np.empty(len(groups), dtype=np.int32)
    member_start = np.zeros(len(groups) + 1, dtype=np.int32)
    for g, (members, shared) in enumerate(groups):
        block_tables[g, :shared] = table[members[0], :shared]
        lens[g] = shared * block_size
        kv_starts[members] = shared * block_size
        member_start[g + 1] = member_start[g] + len(members)
    members = np.concatenate([m for m, _ in groups]).astype(np.int32)
    return CascadePlan(kv_starts, block_tables, lens, member_start, members)


def window_group_tables(plan: CascadePlan, window_table: np.ndarray, first_positions: np.ndarray,
                        block_size: int) -> np.ndarray:
    """A window group's blocks for the groups of ``plan`` (made from the block table): group g's row
    is taken from its member whose first query token comes first, whose window reaches furthest back.
    Its entries below that member's window may be 0 or stale, but no member reads them: every other
    member's window starts no earlier (a window table holds a request's pages from
    ``KVLayout.first_needed_block`` of its computed tokens on)."""
    tables = np.zeros_like(plan.block_tables)
    for g in range(len(plan.lens)):
        members = plan.members[plan.member_start[g]:plan.member_start[g + 1]]
        source = members[np.argmin(first_positions[members])]
        shared = int(plan.lens[g]) // block_size
        tables[g, :shared] = window_table[source, :shared]
    return tables
