"""The router fed the engines' incremental reports (a base plus the changes since, engine/prefix_report.py)
against the router fed whole snapshots: over random runs of two replicas' pools (hits, frees,
evictions, the host tier, undone steps, resets) they hold the same sets and make the same choices,
and so does a router that saw only some of the reports."""

from __future__ import annotations

import random

import pytest

from cluster.router import (
    ReplicaPrefixState,
    choose_by_prefix,
    parse_hashes,
    prompt_block_hashes,
)
from engine.prefix_report import PrefixReport
from tests.engine.test_prefix_report_incremental import BS, Replica, prompt

LIMIT = 8


def whole(replica: Replica) -> dict:
    """What the replica reported before the change log: its whole set, every time."""
    return {"prefix_hashes": replica.kv.cached_hash_digest(LIMIT), "block_size": BS}


@pytest.mark.parametrize("seed", range(2))
def test_routers_fed_changes_choose_as_routers_fed_whole_reports(seed):
    rng = random.Random(seed)
    replicas = {name: Replica(seed * 10 + i, limit=LIMIT) for i, name in enumerate(("a", "b"))}
    reporters = {name: PrefixReport(r.kv.block_pool.recent.read, rebase_after=3) for name, r in replicas.items()}
    by_changes = {name: ReplicaPrefixState() for name in replicas}
    by_whole = {name: ReplicaPrefixState() for name in replicas}
    sparse = {name: ReplicaPrefixState() for name in replicas}  # sees about one report in three
    prompts = [prompt(rng) for _ in range(8)]
    matches = 0
    for step in range(250):
        for name, replica in replicas.items():
            replica.step()
            if rng.random() < 0.5:
                continue  # no report this time: the changes pile up (and may outgrow the log)
            payload = {**reporters[name].report(), "block_size": BS}
            by_changes[name].observe(payload)
            by_whole[name].observe(whole(replica))
            if rng.random() < 1 / 3:
                sparse[name].observe(payload)
            expected = by_whole[name].reported.as_set()
            assert by_changes[name].reported.as_set() == expected
            assert expected == parse_hashes(b"".join(h[:8] for h in replica.kv.block_pool.recent.top))
        loads = {"a": step % 3, "b": 1}
        for p in prompts:
            hashes = prompt_block_hashes(p, BS)
            chosen = [choose_by_prefix(hashes, {n: s.reported for n, s in states.items()}, loads, 8,
                                       random.Random(step)) for states in (by_changes, by_whole)]
            assert chosen[0] == chosen[1]
            matches += any(h in by_whole["a"].reported or h in by_whole["b"].reported for h in hashes)
        for name in replicas:  # the sparse router catches up with the next report it sees
            sparse[name].observe({**reporters[name].payload(), "block_size": BS})
            assert sparse[name].reported.as_set() == by_whole[name].reported.as_set()
    assert matches > 50  # the prompts did hit reported prefixes: the choices were by prefix
    assert sum(r.num_full_reads for r in reporters.values()) > 4  # overflowed logs, resets: whole reads merged
