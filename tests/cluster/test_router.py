"""The prefix-aware request router: the pure policy, the per-replica state, and the Serve class
driven the way Serve drives it, with fake replicas (no Ray cluster)."""

from __future__ import annotations

import asyncio
import random
import uuid
from array import array
from collections import Counter
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata, RunningReplicaInfo
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID

from cluster.router import (
    PrefixAwareRequestRouter,
    ReplicaPrefixState,
    choose_by_prefix,
    extract_prompt,
    match_length,
    parse_hashes,
    prompt_block_hashes,
)
from engine.block_hash import hash_blocks

BS = 4
DEPLOYMENT = DeploymentID(name="LLMServer", app_name="kvserve")
SYSTEM = list(range(100, 116))  # 4 full blocks shared by the "chat" prompts below
CHAIN = prompt_block_hashes(SYSTEM, BS)


def stats(hashes: list[int], waiting: int = 0, running: int = 0) -> dict[str, Any]:
    """What LLMServer.record_routing_stats returns."""
    return {"prefix_hashes": array("Q", hashes).tobytes(), "block_size": BS, "num_waiting": waiting,
            "num_running": running}


def choose(prompt, held: dict[str, set[int]], loads: dict[str, int], threshold: float = 8) -> str:
    return choose_by_prefix(prompt, held, loads, threshold, random.Random(0))[0]


# --- the pure policy --------------------------------------------------------------------------------

def test_prompt_hashes_are_the_engines_truncated_chain():
    engine_format = b"".join(h[:8] for h in hash_blocks(SYSTEM, BS))  # KVCacheManager.cached_hash_digest
    assert parse_hashes(engine_format) == set(CHAIN) and len(CHAIN) == 4
    assert parse_hashes(engine_format + b"xyz") == set(CHAIN)  # a torn tail is ignored
    assert prompt_block_hashes(SYSTEM + [1, 2, 3], BS) == CHAIN  # the partial block is not hashed
    assert all(0 <= h < 2**64 for h in CHAIN)


def test_longest_chain_wins():
    held = {"a": set(CHAIN[:1]), "b": set(CHAIN[:3]), "c": set(CHAIN[:2]), "d": set()}
    assert choose(CHAIN, held, dict.fromkeys(held, 0)) == "b"
    assert choose_by_prefix(CHAIN, held, {}, 8, random.Random(1))[0] == "b"  # unknown loads count 0


def test_partial_chain_and_a_break_stops_the_match():
    assert match_length(CHAIN, set(CHAIN[:2])) == 2
    assert match_length(CHAIN, set(CHAIN[1:])) == 0  # no first block: nothing is reusable
    broken = {CHAIN[0], CHAIN[1], CHAIN[3]}
    assert match_length(CHAIN, broken) == 2
    assert choose(CHAIN, {"broken": broken, "three": set(CHAIN[:3])}, {"broken": 0, "three": 0}) == "three"


def test_cache_salt_changes_every_hash():
    salted = prompt_block_hashes(SYSTEM, BS, cache_salt="tenant-a")
    assert not set(salted) & set(CHAIN)
    assert salted != prompt_block_hashes(SYSTEM, BS, cache_salt="tenant-b")
    assert match_length(salted, set(CHAIN)) == 0
    held = {"plain": set(CHAIN), "tenant": set(salted)}
    assert choose(salted, held, {"plain": 0, "tenant": 3}) == "tenant"
    assert extract_prompt(["id", SYSTEM, None], {"cache_salt": "t"}) == (SYSTEM, "t")
    assert extract_prompt(["id", SYSTEM, None, "t"], {}) == (SYSTEM, "t")


def test_ties_go_to_the_least_loaded():
    held = {"a": set(CHAIN), "b": set(CHAIN), "c": set()}
    assert choose(CHAIN, held, {"a": 5, "b": 1, "c": 0}) == "b"
    assert choose(CHAIN, held, {"a": 1, "b": 5, "c": 0}) == "a"


def test_imbalance_overrides_affinity():
    held = {"hot": set(CHAIN), "cold": set()}
    assert choose(CHAIN, held, {"hot": 20, "cold": 0}, threshold=8) == "cold"
    assert choose(CHAIN, held, {"hot": 8, "cold": 0}, threshold=8) == "hot"  # "more than" the threshold
    # the best match among the replicas that are not overloaded beats the least loaded one
    held = {"hot": set(CHAIN), "warm": set(CHAIN[:2]), "cold": set()}
    assert choose(CHAIN, held, {"hot": 20, "warm": 5, "cold": 0}, threshold=8) == "warm"


def test_no_match_is_power_of_two_and_fallbacks_follow():
    held = {r: set() for r in "abcdef"}
    loads = {r: i for i, r in enumerate("abcdef")}
    for seed in range(20):
        order = choose_by_prefix(CHAIN, held, loads, 8, random.Random(seed))
        assert len(order) == 3 and len(set(order)) == 3
        assert loads[order[1]] <= loads[order[2]]
    picks = {choose_by_prefix(CHAIN, held, loads, 8, random.Random(s))[0] for s in range(50)}
    assert "f" not in picks and len(picks) > 2  # never the most loaded, yet spread
    assert choose_by_prefix(CHAIN, {"only": set()}, {}, 8) == ["only"]


# --- per-replica state --------------------------------------------------------------------------------

def test_stats_are_parsed_only_when_they_change():
    state = ReplicaPrefixState()
    report = stats(CHAIN[:2], waiting=1, running=2)
    state.observe(report)
    parsed = state.reported
    assert state.generation == 1 and state.load == 3 and state.block_size == BS and parsed.as_set() == set(CHAIN[:2])
    state.observe(report)
    state.observe(dict(report))  # the same report re-broadcast (a new object)
    assert state.generation == 1 and state.reported is parsed
    state.observe(stats(CHAIN[:2], waiting=0, running=3))  # a new report, same cache: not re-parsed
    assert state.generation == 2 and state.reported is parsed
    state.observe({})  # Serve's "no report yet" is never a report
    assert state.generation == 2


def test_recent_chains_live_until_the_second_report():
    state = ReplicaPrefixState()
    state.record(CHAIN)
    assert match_length(CHAIN, *state.holding) == 4
    state.observe(stats([], waiting=1))  # may predate the request reaching the cache
    assert match_length(CHAIN, *state.holding) == 4
    state.observe(stats([], waiting=0))
    assert match_length(CHAIN, *state.holding) == 0 and not state.recent
    state.record(CHAIN)
    state.observe(stats(CHAIN[:2]))  # the report confirms two blocks: they leave `recent`
    assert set(state.recent) == set(CHAIN[2:]) and match_length(CHAIN, *state.holding) == 4


def test_recent_memory_is_bounded_and_evicts_chain_tails():
    state = ReplicaPrefixState(max_recent=3)
    state.record(CHAIN)
    assert len(state.recent) == 3 and match_length(CHAIN, *state.holding) == 3


# --- the Serve request router -------------------------------------------------------------------------

def replica_info(name: str, routing_stats: dict | None = None) -> RunningReplicaInfo:
    return RunningReplicaInfo(
        replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), node_id="node", node_ip="127.0.0.1",
        availability_zone=None, actor_name=f"replica-{name}", max_ongoing_requests=16,
        routing_stats=routing_stats or {},
    )


class FakeReplica:
    """The part of Serve's RunningReplica a router and its routing loop use."""

    def __init__(self, info: RunningReplicaInfo) -> None:
        self._info, self.queue_len = info, 0

    def update_replica_info(self, info: RunningReplicaInfo) -> None:
        self._info = info

    def __getattr__(self, name: str) -> Any:  # replica_id, routing_stats, max_ongoing_requests, ...
        return getattr(self._info, name)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(**kwargs: Any) -> PrefixAwareRequestRouter:
    """As Serve's AsyncioRouter does (ray/serve/_private/router.py): the class out of the
    cloudpickled RequestRouterConfig, constructed with the handle's arguments, then
    initialize_state(**request_router_kwargs)."""
    config = RequestRouterConfig(request_router_class="cluster.router.PrefixAwareRequestRouter",
                                 request_router_kwargs=kwargs, request_routing_stats_period_s=1.0)
    router = config.get_request_router_class()(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, self_node_id="node",
        self_actor_id="handle", self_actor_handle=None, use_replica_queue_len_cache=True,
        create_replica_wrapper_func=FakeReplica, prefer_local_node_routing=False,
        prefer_local_az_routing=False, self_availability_zone=None,
    )
    router.initialize_state(**config.request_router_kwargs)
    return router


def generate_request(prompt: list[int], method: str = "generate", salt: str | None = None,
                     internal_id: str | None = None) -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id=internal_id or uuid.uuid4().hex,
                           call_method=method, is_streaming=True)
    return PendingRequest(args=["r", prompt, None], kwargs={"cache_salt": salt}, metadata=meta)


async def route(router: PrefixAwareRequestRouter, prompt: list[int], **kw: Any) -> str:
    """The whole Serve routing loop (choose_replicas ranks, queue lengths, fulfilment), then the
    acceptance callback the handle fires."""
    pr = generate_request(prompt, **kw)
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), timeout=5)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id.unique_id


def test_serve_routes_to_the_replica_that_reported_the_prefix():
    async def main() -> None:
        router = make_router(imbalance_threshold=4)
        router._update_running_replicas([replica_info("a"), replica_info("b"), replica_info("c", stats(CHAIN))])
        assert router.block_size == BS  # learned from the report
        for _ in range(5):
            assert await route(router, SYSTEM + [7, 7, 7, 7, 1]) == "c"
        # the report is replaced through Serve's long-poll update: a new RunningReplicaInfo
        router._update_running_replicas([replica_info("a", stats(CHAIN)), replica_info("b"),
                                         replica_info("c", stats([], running=1))])
        router._update_running_replicas([replica_info("a", stats(CHAIN)), replica_info("b"),
                                         replica_info("c", stats([], running=2))])
        assert await route(router, SYSTEM) == "a"

    asyncio.run(main())


def test_recent_assignments_stick_before_any_stats():
    async def main() -> None:
        router = make_router(block_size=BS)
        router._update_running_replicas([replica_info(n) for n in "abcd"])
        first = await route(router, SYSTEM + [1, 2, 3, 4])
        assert all([await route(router, SYSTEM + [9] * i) == first for i in range(8)])
        salted = {await route(router, SYSTEM, salt="other-tenant")}
        assert all([await route(router, SYSTEM, salt="other-tenant") in salted for _ in range(4)])

    asyncio.run(main())


def test_a_burst_sticks_up_to_the_imbalance_threshold():
    """Within a burst Serve's queue lengths lag (a request counts once the handle has sent it): the
    router counts its own hand-overs, so the threshold holds before any acceptance or report."""
    async def main() -> None:
        for threshold, most in ((100, 12), (2, 5)):
            router = make_router(block_size=BS, imbalance_threshold=threshold)
            router._update_running_replicas([replica_info(n) for n in "abc"])
            burst = [router._choose_replica_for_request(generate_request(SYSTEM)) for _ in range(12)]
            counts = Counter(r.replica_id for r in await asyncio.wait_for(asyncio.gather(*burst), timeout=5))
            assert max(counts.values()) <= most and (threshold == 100) == (len(counts) == 1)
        assert router.prompt_hashes(pr := generate_request(SYSTEM)) is router.prompt_hashes(pr)  # hashed once

    asyncio.run(main())


def test_sibling_calls_sharing_an_internal_request_id_each_get_their_replica():
    """Calls made while serving one Serve request share its internal request id (an ingress fanning
    out a batch): Serve's id-matched hand-over would fulfil the first and spin on the rest."""
    async def main() -> None:
        other = list(range(200, 216))
        router = make_router(imbalance_threshold=100)
        router._update_running_replicas([replica_info("a", stats(CHAIN)),
                                         replica_info("b", stats(prompt_block_hashes(other, BS))), replica_info("c")])
        batch = [generate_request(SYSTEM if i % 2 == 0 else other, internal_id="parent") for i in range(10)]
        chosen = await asyncio.wait_for(
            asyncio.gather(*[router._choose_replica_for_request(pr) for pr in batch]), timeout=5)
        assert [r.replica_id.unique_id for r in chosen] == ["a", "b"] * 5

    asyncio.run(main())


def test_imbalance_uses_serves_queue_lengths():
    async def main() -> None:
        router = make_router(imbalance_threshold=2)
        router._update_running_replicas([replica_info("a", stats(CHAIN)), replica_info("b", stats([]))])
        router.on_new_queue_len_info(ReplicaID("a", DEPLOYMENT), 10)
        router.on_new_queue_len_info(ReplicaID("b", DEPLOYMENT), 0)
        replicas = list(router.curr_replicas.values())
        ranks = await router.choose_replicas(replicas, generate_request(SYSTEM))
        assert ranks[0][0].replica_id.unique_id == "b"

    asyncio.run(main())


def test_other_calls_fall_back_to_power_of_two():
    async def main() -> None:
        router = make_router(block_size=BS)
        router._update_running_replicas([replica_info("a", stats(CHAIN)), replica_info("b"), replica_info("c")])
        replicas = list(router.curr_replicas.values())
        for pr in (generate_request(SYSTEM, method="__call__"), generate_request([1, 2]),  # shorter than a block
                   PendingRequest(args=["r"], kwargs={}, metadata=generate_request(SYSTEM).metadata)):
            ranks = await router.choose_replicas(replicas, pr)
            assert len(ranks) == 1 and len(ranks[0]) == 2
        assert await router.choose_replicas(replicas, None) and await router.choose_replicas([], None) == []
        assert not any(s.recent for s in router._states.values())
        assert (await route(router, SYSTEM, method="__call__")) in "abc"

    asyncio.run(main())


def test_replicas_that_leave_are_forgotten():
    async def main() -> None:
        router = make_router(block_size=BS)
        router._update_running_replicas([replica_info(n) for n in "ab"])
        await route(router, SYSTEM)
        router._update_running_replicas([replica_info("b")])
        assert {r.unique_id for r in router._states} <= {"b"}
        assert await route(router, SYSTEM) == "b"

    asyncio.run(main())


def test_unhashable_prompts_are_routed_not_dropped():
    """Token ids that do not fit the hash's int64 (2**64 inside a full block) used to raise OverflowError
    in the routing loop, and the request was never answered: now they go to a random pair (the engine
    then refuses them with a clear error), and the other requests keep their prefix routing."""
    huge = SYSTEM[:4] + [2**64] + SYSTEM[5:]
    assert extract_prompt(["id", huge, None], {}) == (None, None)
    assert extract_prompt(["id", [-(2**63) - 1] * 8, None], {}) == (None, None)
    assert extract_prompt(["id", [True] * 8, None], {}) == (None, None)  # not token ids
    assert extract_prompt(["id", [2**63 - 1] * 8, None], {})[0] == [2**63 - 1] * 8  # fits: hashable
    assert len(prompt_block_hashes([2**63 - 1] * 8, BS)) == 2

    async def main() -> None:
        router = make_router(imbalance_threshold=100)
        router._update_running_replicas([replica_info("a"), replica_info("b"), replica_info("c", stats(CHAIN))])
        for prompt in (huge, [2**64] * 16, [-1, -(2**70)] * 8):
            assert await route(router, prompt) in "abc"  # answered, within route's timeout
            ranks = await router.choose_replicas(list(router.curr_replicas.values()), generate_request(prompt))
            assert len(ranks) == 1 and len(ranks[0]) == 2  # the random pair
        assert await route(router, SYSTEM) == "c"

    asyncio.run(main())


def test_a_failing_policy_routes_at_random_and_logs(caplog):
    """Whatever goes wrong inside the policy, the request gets a replica (and the failure is logged)."""
    async def main() -> list[str]:
        router = make_router(block_size=BS)
        router._update_running_replicas([replica_info(n, stats(CHAIN)) for n in "ab"])

        def broken(pending_request):
            raise RuntimeError("policy bug")

        router.prompt_hashes = broken
        return [await route(router, SYSTEM) for _ in range(4)]

    assert set(asyncio.run(main())) <= {"a", "b"}
    assert any("prefix-aware routing failed" in r.getMessage() and r.exc_info for r in caplog.records)
