"""Counters and histograms the engine keeps (stdlib only). ``api/metrics.py`` turns the stats dicts
built from them into Prometheus metric families at scrape time."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

# seconds; the same spirit as vLLM's buckets, so dashboards carry over, and reaching long generations
# (a 2k-token answer at 30 ms a token is a minute end to end)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 240.0, 480.0, 960.0)
# tokens per request (prompt or generated): 1-2-5 steps, as vLLM's request_*_tokens histograms
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# how a finished request (each of its n samples) ended well; "error" is a failure, not counted here
SUCCESS_REASONS = ("stop", "length", "abort")


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, plus +Inf last
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total, "count": self.count}

    def quantile(self, q: float) -> float:
        """Upper bucket bound below which a ``q`` share of observations falls (inf if beyond)."""
        target, seen = q * self.count, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            seen += n
            if seen >= target and n:
                return bound
        return 0.0


@dataclass
class SchedulerStats:
    queue_time: Histogram = field(default_factory=Histogram)  # arrival -> first scheduled, seconds
    prefix_cache_queries: int = 0  # prompt tokens looked up (first schedule of a request only)
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    kv_peak_blocks: int = 0  # most blocks held by requests after any schedule
    kv_waste_at_peak: float = 0.0  # share of the slots in those blocks that held no token then

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class HostTierStats:
    """The host KV tier's counters, in blocks: lookups that reached the tier (a pool miss), hits
    restored from it, blocks copied out. A step that is undone takes its own back."""

    queries: int = 0  # blocks looked up in the tier after missing the pool
    hits: int = 0  # of those, blocks found and restored into the pool
    offloaded: int = 0  # blocks copied out of the pool into the tier

    def as_stats(self, block_size: int, block_bytes: int, num_slots: int, num_resident: int,
                 num_evictions: int) -> dict:
        """The ``stats()`` keys: tokens for queries and hits (as the prefix cache counts), bytes over
        every rank for the copies."""
        return {
            "host_kv_cache_queries": self.queries * block_size,
            "host_kv_cache_hits": self.hits * block_size,
            "host_kv_cache_hit_blocks": self.hits,
            "host_kv_cache_offloaded_blocks": self.offloaded,
            "host_kv_cache_evictions": num_evictions,
            "kv_offload_bytes": self.offloaded * block_bytes,
            "kv_restore_bytes": self.hits * block_bytes,
            "host_kv_cache_blocks": num_slots,
            "host_kv_cache_blocks_used": num_resident,
            "host_kv_cache_usage": num_resident / num_slots if num_slots else 0.0,
        }


@dataclass
class RequestStats:
    """Finished requests, one per sample as vLLM counts its n > 1 children: how each ended (stop,
    length, abort) and its prompt and generated token counts. Samples that ended in an error are
    not successes and are left out."""

    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUCCESS_REASONS, 0))
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    generation_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))

    def observe(self, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if finish_reason not in self.finished:
            return
        self.finished[finish_reason] += 1
        self.prompt_tokens.observe(num_prompt_tokens)
        self.generation_tokens.observe(num_generation_tokens)


@dataclass
class StepTimings:
    """Where step time goes: the whole step, the model forward on rank 0, rank 0's execute call, and
    the dispatch (the executor's call minus rank 0's own work: messaging to and from the ranks)."""

    num_steps: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    execute_time_s: float = 0.0
    dispatch_time_s: float = 0.0
    dispatch_samples: deque = field(default_factory=lambda: deque(maxlen=4096))

    def record(self, step_s: float, forward_s: float, execute_s: float, dispatch_s: float) -> None:
        self.num_steps += 1
        self.step_time_s += step_s
        self.forward_time_s += forward_s
        self.execute_time_s += execute_s
        self.dispatch_time_s += dispatch_s
        self.dispatch_samples.append(dispatch_s)

    @property
    def overhead_fraction(self) -> float:
        return 1.0 - self.forward_time_s / self.step_time_s if self.step_time_s else 0.0
