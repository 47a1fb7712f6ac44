"""Prefix-aware request routing for the LLMServer deployment (a Ray Serve ``RequestRouter``).

Policy, for one ``generate(request_id, prompt_token_ids, params, cache_salt=...)`` call:

1. Hash the prompt's full blocks once (``engine.block_hash.hash_blocks``, 8-byte truncation, the
   same values every replica's prefix cache holds) and keep them for the request's retries.
2. Per candidate replica, the match is the number of *leading* prompt hashes it holds: the hashes
   of its last routing-stats report (its pool's cached blocks, then those only its host KV tier
   holds: a tier hit is restored, not recomputed) plus the chains recently routed to it (stop at
   the first miss).
3. Eligible replicas are those whose load is within ``imbalance_threshold`` of the least loaded one
   (load: Serve's queue-length cache, else the reported ``num_waiting + num_running``, else 0;
   plus the requests chosen for it that the handle has not sent yet, which Serve does not count).
   Pick the longest match among them, ties to the least loaded. If only overloaded replicas hold
   the prefix, pick the least loaded replica (imbalance overrides affinity). If nobody holds it,
   power of two choices, as Serve's default router.
4. Return ``[[chosen], [fallback 1], [fallback 2]]`` (two random others, by load): Serve tries
   them in that order when the chosen replica is full. The replica goes to *that* request.

Non-``generate`` calls, prompts shorter than one block, and requests routed before any block size is
known go to a random pair of replicas, of which Serve takes the one with the shorter queue. So do
prompts the router cannot hash (token ids that are not int64: the engine refuses them with a clear
error) and any routing whose policy fails: an exception in ``choose_replicas`` would leave the request
unrouted and its caller waiting forever, so every one falls back to the random pair.

Reports lag (one per ``request_routing_stats_period_s``), so each routing records the prompt's
chain at the chosen replica (and again at the replica that accepted it, ``on_request_routed``):
same-prefix requests stick within a period, bursts included. A recorded chain lives until the
*second* report after it; the first may predate the request reaching the replica's cache.

A report (``engine/prefix_report.py``) is a base, ``prefix_hashes``, plus the hashes added and
removed since it, ``prefix_added`` / ``prefix_removed``: the base is parsed only when it changes
(every few thousand changes), each report's changes are small. Every report stands alone, so a
router that saw only some of them holds the same set as one that saw all.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import weakref
from array import array
from collections import OrderedDict, defaultdict, deque
from collections.abc import Container, Hashable, Mapping, Sequence
from itertools import islice, takewhile
from typing import Any, TypeVar, Union

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.block_hash import hash_blocks

HASH_BYTES = 8  # replicas report block hashes truncated to this many bytes
WORD = "Q"  # ... which the router reads as unsigned 64-bit ints (native order, same on both sides)
assert array(WORD).itemsize == HASH_BYTES
logger = logging.getLogger("ray.serve")
K = TypeVar("K", bound=Hashable)
Holding = Union[Container[int], tuple[Container[int], ...]]  # a replica's hashes, in one or more sets


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """The prompt's full-block chained hashes, truncated to 8 bytes, as ints (one pass)."""
    return list(array(WORD, b"".join(h[:HASH_BYTES] for h in hash_blocks(token_ids, block_size, cache_salt))))


def parse_hashes(raw: bytes) -> set[int]:
    """``record_routing_stats()["prefix_hashes"]`` (8-byte hashes, concatenated) as a set of ints."""
    return set(array(WORD, raw[:len(raw) - len(raw) % HASH_BYTES]))


class ReportedHashes:
    """A replica's reported hashes: ``(base - removed) | added``, without building that set."""

    __slots__ = ("added", "base", "removed")

    def __init__(self, base: set[int] | None = None, added: set[int] | None = None,
                 removed: set[int] | None = None) -> None:
        self.base = base if base is not None else set()
        self.added = added if added is not None else set()
        self.removed = removed if removed is not None else set()

    def __contains__(self, h: object) -> bool:
        return h in self.added or (h in self.base and h not in self.removed)

    def as_set(self) -> set[int]:
        return (self.base - self.removed) | self.added


def match_length(prompt_hashes: Sequence[int], *present: Container[int]) -> int:
    """Leading prompt hashes held by any of ``present`` (stop at the first miss): the reusable blocks."""
    n = 0
    while True:
        start = n
        for held in present:
            n += len(list(takewhile(held.__contains__, islice(prompt_hashes, n, None))))
        if n == start or n == len(prompt_hashes):
            return n


def choose_by_prefix(
    prompt_hashes: Sequence[int],
    replica_hashes: Mapping[K, Holding],
    loads: Mapping[K, float | None],
    imbalance_threshold: float,
    rng: random.Random | None = None,
) -> list[K]:
    """Replica ids in preference order: the choice of the module docstring's policy, then up to
    two random others by load. Unknown loads count as 0."""
    rng = rng or random.Random()
    ids = list(replica_hashes)
    if not ids:
        return []
    load = {r: loads.get(r) or 0 for r in ids}
    match = {r: match_length(prompt_hashes, *(h if isinstance(h, tuple) else (h,)))
             for r, h in replica_hashes.items()}

    def least_loaded(group: list[K]) -> K:
        lowest = min(load[r] for r in group)
        return rng.choice([r for r in group if load[r] == lowest])

    floor = min(load.values())
    eligible = [r for r in ids if load[r] - floor <= imbalance_threshold]
    best = max(match[r] for r in eligible)
    if best > 0:
        chosen = least_loaded([r for r in eligible if match[r] == best])
    elif any(match.values()):
        chosen = least_loaded(ids)  # only overloaded replicas hold the prefix
    else:
        chosen = least_loaded(rng.sample(ids, min(2, len(ids))))  # power of two choices
    rest = [r for r in ids if r != chosen]
    return [chosen, *sorted(rng.sample(rest, min(2, len(rest))), key=load.__getitem__)]


class ReplicaPrefixState:
    """What the router believes one replica's prefix cache holds.

    Invariants: ``reported`` holds ``parse_hashes(raw)`` less the report's ``prefix_removed`` plus its
    ``prefix_added`` for the last report (a non-empty stats dict that differs from the one before); ``generation`` counts those reports; ``recent`` maps hashes of
    chains routed here to the generation current when routed, in LRU order, at most ``max_recent``
    of them, each chain inserted tail first (eviction shortens a chain, never beheads it), and no
    entry is older than the previous report (tag >= generation - 1).
    """

    def __init__(self, max_recent: int = 8192) -> None:
        self.max_recent = max_recent
        self.raw = b""
        self.reported = ReportedHashes()
        self.recent: OrderedDict[int, int] = OrderedDict()
        self.generation = 0
        self.block_size: int | None = None
        self.load: int | None = None
        self._seen: object = None  # the stats object last observed (identity: skip unchanged)
        self._last_report: Mapping[str, Any] = {}
        self._delta: tuple[bytes, bytes] = (b"", b"")  # the last report's added and removed hashes

    @property
    def holding(self) -> tuple[Container[int], ...]:
        """The hashes believed cached here, for ``match_length`` / ``choose_by_prefix``."""
        return self.reported, self.recent

    def observe(self, stats: Mapping[str, Any] | None) -> None:
        """Take the replica's current ``routing_stats``; parses only a new, different report."""
        if stats is self._seen:
            return
        self._seen = stats
        if not isinstance(stats, Mapping) or not stats or stats == self._last_report:
            return  # nothing reported yet, or the same report re-broadcast
        self._last_report = stats
        self.block_size = stats.get("block_size") or None
        waiting, running = stats.get("num_waiting"), stats.get("num_running")
        self.load = None if waiting is None and running is None else (waiting or 0) + (running or 0)
        raw, delta = stats.get("prefix_hashes") or b"", (stats.get("prefix_added") or b"",
                                                          stats.get("prefix_removed") or b"")
        if raw != self.raw or delta != self._delta:
            base = self.reported.base if raw == self.raw else parse_hashes(raw)  # new every few thousand changes
            self.raw, self._delta = raw, delta
            self.reported = ReportedHashes(base, parse_hashes(delta[0]), parse_hashes(delta[1]))
        self.generation += 1
        for h in [h for h, tag in self.recent.items() if tag < self.generation - 1 or h in self.reported]:
            del self.recent[h]

    def record(self, prompt_hashes: Sequence[int]) -> None:
        """Treat this chain as cached here until the second report from now."""
        for h in reversed(prompt_hashes):
            self.recent[h] = self.generation
            self.recent.move_to_end(h)
        while len(self.recent) > self.max_recent:
            self.recent.popitem(last=False)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the block hash packs ("q"); the engine checks the vocabulary


def extract_prompt(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Sequence[int] | None, str | None]:
    """``(prompt_token_ids, cache_salt)`` of a ``generate(request_id, prompt_token_ids, params,
    cache_salt=None)`` call, by keyword or position; ``(None, None)`` when there are no token ids or
    they cannot be hashed (not all int64 integers: routed at random, then refused by the engine)."""
    token_ids = kwargs.get("prompt_token_ids", args[1] if len(args) > 1 else None)
    salt = kwargs.get("cache_salt", args[3] if len(args) > 3 else None)
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        return None, None
    if not all(type(t) is int and INT64_MIN <= t <= INT64_MAX for t in token_ids):
        return None, None
    return token_ids, salt if isinstance(salt, str) else None


class PrefixAwareRequestRouter(RequestRouter):
    """Serve request router with the policy of the module docstring.

    ``request_router_kwargs`` (passed to ``initialize_state``): ``imbalance_threshold`` (queue
    length difference above which load beats affinity, default 8), ``block_size`` (the engines'
    block size, used until a replica reports one; without either, prefix routing waits for the
    first report), ``max_recent_hashes`` (recently routed hashes remembered per replica),
    ``methods`` (deployment methods routed by prefix, default ``["generate"]``).
    """

    max_memoized_prompts = 512  # requests being routed (accepted ones leave at once)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()

    def initialize_state(self, imbalance_threshold: float = 8, block_size: int | None = None,
                         max_recent_hashes: int = 8192, methods: Sequence[str] = ("generate",)) -> None:
        """Set the policy's parameters (Serve calls this once with ``request_router_kwargs``)."""
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.imbalance_threshold = float(imbalance_threshold)
        self.block_size = block_size
        self.max_recent_hashes = max_recent_hashes
        self.methods = frozenset(methods)
        self._states: dict[ReplicaID, ReplicaPrefixState] = {}
        # id(PendingRequest) -> (weak reference to it, prompt hashes): sibling calls share internal ids
        self._prompts: OrderedDict[int, tuple[weakref.ref, list[int]]] = OrderedDict()
        self._choosing: weakref.WeakKeyDictionary[asyncio.Task, PendingRequest] = weakref.WeakKeyDictionary()
        self._rng = random.Random()
        self._warned: set[ReplicaID] = set()  # replicas whose block size differs (logged once)
        self._unsent: defaultdict[ReplicaID, deque[float]] = defaultdict(deque)  # choice times

    def state(self, replica: RunningReplica) -> ReplicaPrefixState:
        """The replica's prefix state, refreshed from its current ``routing_stats``."""
        state = self._states.get(replica.replica_id)
        if state is None:
            state = self._states[replica.replica_id] = ReplicaPrefixState(self.max_recent_hashes)
        state.observe(replica.routing_stats)
        if state.block_size and self.block_size is None:
            self.block_size = state.block_size
        elif state.block_size and state.block_size != self.block_size and replica.replica_id not in self._warned:
            self._warned.add(replica.replica_id)
            logger.warning("%s reports block_size %s, not %s: never matched", replica.replica_id, state.block_size,
                           self.block_size)
        return state

    def prompt_hashes(self, pending_request: PendingRequest | None) -> list[int] | None:
        """The request's block hashes (memoized), or None: not prefix-routable, or no block size yet."""
        if pending_request is None or pending_request.metadata.call_method not in self.methods:
            return None
        entry = self._prompts.get(id(pending_request))
        if entry is not None and entry[0]() is pending_request:
            return entry[1]
        token_ids, salt = extract_prompt(pending_request.args, pending_request.kwargs)
        if token_ids is None or self.block_size is None:
            return None
        hashes = prompt_block_hashes(token_ids, self.block_size, salt)
        self._prompts[id(pending_request)] = (weakref.ref(pending_request), hashes)
        if len(self._prompts) > self.max_memoized_prompts:
            self._prompts.popitem(last=False)
        return hashes

    def load(self, replica: RunningReplica, state: ReplicaPrefixState) -> int:
        """Serve's cached queue length (ongoing requests) if fresh, else the reported one, plus the
        requests chosen for it and not sent yet (within a burst, Serve's count lags by all of them)."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        unsent = self._unsent[replica.replica_id]
        while unsent and unsent[0] < time.monotonic() - 1.0:
            unsent.popleft()  # chosen, then sent elsewhere or cancelled: forget it
        return (queue_len if queue_len is not None else state.load or 0) + len(unsent)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """One routing attempt: ranks of replicas, most preferred first (see the module docstring).
        Never raises: a failure of the policy routes the request to a random pair (and is logged)."""
        if not candidate_replicas:
            return []
        task = asyncio.current_task(loop=self._event_loop)
        if pending_request is not None and task is not None:
            self._choosing[task] = pending_request  # for _fulfill_next_pending_request
        try:
            return self._choose_by_policy(candidate_replicas, pending_request)
        except Exception:
            logger.exception("prefix-aware routing failed; routing the request to a random pair of replicas")
            return [self._rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _choose_by_policy(self, candidate_replicas: list[RunningReplica],
                          pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        states = {r.replica_id: self.state(r) for r in candidate_replicas}
        prompt = self.prompt_hashes(pending_request)
        if not prompt:
            return [self._rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self.load(r, states[rid]) for rid, r in by_id.items()}
        holdings = {rid: state.holding for rid, state in states.items()}
        order = choose_by_prefix(prompt, holdings, loads, self.imbalance_threshold, self._rng)
        states[order[0]].record(prompt)
        self._unsent[order[0]].append(time.monotonic())  # counted until the handle sends a request
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica accepted the request: its prompt's chain is (about to be) cached there."""
        entry = self._prompts.pop(id(pending_request), None)
        state = self._states.get(replica_id)
        if entry is not None and entry[0]() is pending_request and state is not None:
            state.record(entry[1])

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Serve's (private, Ray 2.60) hand-over of a selected replica. The base matches the pending
        request by internal request id, which the calls made while serving one Serve request share
        (an ingress fanning out a batch): it fulfils the first and its siblings' routing tasks spin
        forever. Hand the replica to the request this routing task chose it for."""
        pr = self._choosing.get(asyncio.current_task(loop=self._event_loop))
        if pr is None or pr.future.done() or pr.metadata is not request_metadata:
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._record_queue_wait_time(pr)
        pr.future.set_result(replica)
        self._remove_pending_request_from_indices(pr)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """The handle sent a request: Serve's queue-length cache counts it from now on."""
        if self._unsent[replica_id]:
            self._unsent[replica_id].popleft()
        super().on_send_request(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's replica-set update (also how new routing stats arrive): takes the new reports
        and forgets the state of replicas that left."""
        super().update_replicas(replicas)
        for replica_id in [rid for rid in self._states if rid not in self.curr_replicas]:
            del self._states[replica_id]
            self._unsent.pop(replica_id, None)
        for replica in replicas:
            self.state(replica)
