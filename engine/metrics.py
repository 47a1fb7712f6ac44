"""Counters and histograms the engine keeps; exported as Prometheus text by the Serve app."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

# seconds; the same spirit as vLLM's buckets, so dashboards carry over
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


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


# Prometheus exposition of engine stats. Names follow vLLM's where one exists, under "kvserve:".
_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits_total", "Prompt tokens served from the prefix cache."),
    "num_preemptions": ("num_preemptions_total", "Requests preempted (recompute)."),
    "num_prompt_tokens": ("prompt_tokens_total", "Prompt tokens admitted."),
    "num_generation_tokens": ("generation_tokens_total", "Tokens generated."),
    "num_worker_restarts": ("worker_restarts_total", "Times the engine rebuilt its ranks after losing one."),
    "num_failed_steps": ("failed_steps_total", "Engine steps that raised (rolled back, not counting lost ranks)."),
    "num_failed_requests": ("failed_requests_total", "Requests failed because a step that held them alone raised."),
}
_GAUGES = {
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Share of KV blocks held by requests (0-1)."),
    "kv_cache_waste": ("kv_cache_waste_perc", "Share of the slots in held blocks that hold no token (0-1)."),
    "kv_cache_usage_peak": ("kv_cache_usage_peak_perc", "Most KV blocks ever held at once, as a share (0-1)."),
    "kv_waste_at_peak": ("kv_cache_waste_at_peak_perc", "Empty slots in held blocks at that peak (0-1)."),
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
}
_HISTOGRAMS = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive output tokens.",
    "e2e_request_latency_seconds": "Time from arrival to the last token.",
    "request_queue_time_seconds": "Time from arrival to the first schedule.",
}


def _labels(labels: dict[str, str], extra: str = "") -> str:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + ",".join(p for p in (text, extra) if p) + "}"


def prometheus_text(stats_by_replica: dict[str, dict], model_name: str) -> str:
    """Prometheus text format (0.0.4) for the stats of every replica, labelled by replica."""
    lines: list[str] = []
    series = [(_labels({"model_name": model_name, "replica": r}), s) for r, s in sorted(stats_by_replica.items())]
    for kind, table in (("counter", _COUNTERS), ("gauge", _GAUGES)):
        for key, (name, help_text) in table.items():
            lines += [f"# HELP kvserve:{name} {help_text}", f"# TYPE kvserve:{name} {kind}"]
            lines += [f"kvserve:{name}{labels} {float(s.get(key, 0))}" for labels, s in series]
    for name, help_text in _HISTOGRAMS.items():
        lines += [f"# HELP kvserve:{name} {help_text}", f"# TYPE kvserve:{name} histogram"]
        for labels, s in series:
            h = s.get("histograms", {}).get(name)
            if h is None:
                continue
            inner = labels[1:-1]
            cumulative = 0
            for bound, count in zip((*h["buckets"], "+Inf"), h["counts"]):
                cumulative += count
                le = bound if bound == "+Inf" else repr(float(bound))
                lines.append(f"kvserve:{name}_bucket{{{inner},le=\"{le}\"}} {cumulative}")
            lines += [f"kvserve:{name}_sum{labels} {h['sum']}", f"kvserve:{name}_count{labels} {h['count']}"]
    return "\n".join(lines) + "\n"
