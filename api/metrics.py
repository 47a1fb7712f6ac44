"""Prometheus exposition of the engines' stats, through ``prometheus_client``.

At scrape time the Serve app (or any host of engines) passes the ``stats()`` dict of each engine
replica; a collector turns them into metric families on a fresh registry and
``prometheus_client.exposition.generate_latest`` renders them, so names, label values and numbers are
escaped and formatted as Prometheus reads them. Names follow vLLM's ``vllm:`` families under
``kvserve:``, with the labels ``model_name`` and ``replica`` (the scheduler actor of each Serve replica).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                            Metric)
from prometheus_client.utils import floatToGoString

PREFIX = "kvserve:"
# what generate_latest writes (the classic text format; newer clients also offer 1.0.0 on request)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "replica")

# stats key -> (family name; counters get "_total" when rendered, help)
COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted (recompute)."),
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens admitted."),
    "num_generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_worker_restarts": ("worker_restarts", "Times the engine rebuilt its ranks after losing one."),
    "num_failed_steps": ("failed_steps", "Engine steps that raised (rolled back, not counting lost ranks)."),
    "num_failed_requests": ("failed_requests", "Requests failed because a step that held them alone raised."),
    "host_kv_cache_queries": ("host_kv_cache_queries", "Prompt tokens looked up in the host KV tier after "
                              "missing the pool."),
    "host_kv_cache_hits": ("host_kv_cache_hits", "Prompt tokens restored from the host KV tier."),
    "host_kv_cache_offloaded_blocks": ("host_kv_cache_offloaded_blocks", "KV blocks copied from the pool to the "
                                       "host tier on eviction."),
    "host_kv_cache_evictions": ("host_kv_cache_evictions", "Host KV tier entries dropped to make room (LRU)."),
    "kv_offload_bytes": ("kv_offload_bytes", "Bytes copied from the KV pool to the host tier, over every rank."),
    "kv_restore_bytes": ("kv_restore_bytes", "Bytes copied from the host tier back into the KV pool, over every "
                         "rank."),
}
GAUGES = {
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prefix cache hits over queries, in tokens."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Share of KV blocks held by requests (0-1)."),
    "kv_cache_waste": ("kv_cache_waste_perc", "Share of the slots in held blocks that hold no token (0-1)."),
    "kv_cache_usage_peak": ("kv_cache_usage_peak_perc", "Most KV blocks ever held at once, as a share (0-1)."),
    "kv_waste_at_peak": ("kv_cache_waste_at_peak_perc", "Empty slots in held blocks at that peak (0-1)."),
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "host_kv_cache_usage": ("host_kv_cache_usage_perc", "Share of the host KV tier's blocks in use (0-1)."),
    "host_kv_cache_blocks": ("host_kv_cache_blocks", "Blocks of the host KV tier on each rank (0: no tier)."),
    "num_kv_blocks": ("kv_cache_blocks", "Blocks of the KV pool (the null block included)."),
    "kv_bytes_per_block_per_rank": ("kv_cache_block_bytes", "Bytes of one KV block on each rank (under pipeline "
                                    "parallelism the rank of the stage with the most layers), in the pool's "
                                    "format (kv_cache_dtype)."),
}
# an info family (value 1): the KV pool's format as a label
CACHE_INFO = ("cache_config_info", "The KV pool's format: kv_cache_dtype is auto (the model's dtype), fp8_e4m3, "
              "fp8_e5m2 or int8.")
# stats["histograms"] key -> help; the family is named after the key
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive output tokens.",
    "e2e_request_latency_seconds": "Time from arrival to the last token.",
    "request_queue_time_seconds": "Time from arrival to the first schedule.",
    "request_prompt_tokens": "Prompt tokens of each finished request.",
    "request_generation_tokens": "Tokens generated for each finished request.",
}
SUCCESS = ("request_success", "Finished requests, by how they ended (stop, length, abort).")


class EngineStatsCollector:
    """A custom collector over a snapshot of every replica's stats, for one scrape."""

    def __init__(self, stats_by_replica: Mapping[str, Mapping], model_name: str) -> None:
        self.series = [((model_name, str(replica)), stats) for replica, stats in sorted(stats_by_replica.items())]

    def collect(self) -> Iterator[Metric]:
        for key, (name, help_text) in COUNTERS.items():
            yield self._fill(CounterMetricFamily(PREFIX + name, help_text, labels=LABELS), key)
        for key, (name, help_text) in GAUGES.items():
            yield self._fill(GaugeMetricFamily(PREFIX + name, help_text, labels=LABELS), key)
        info = GaugeMetricFamily(PREFIX + CACHE_INFO[0], CACHE_INFO[1], labels=(*LABELS, "kv_cache_dtype"))
        for labels, stats in self.series:
            if "kv_cache_dtype" in stats:
                info.add_metric((*labels, str(stats["kv_cache_dtype"])), 1.0)
        yield info
        success = CounterMetricFamily(PREFIX + SUCCESS[0], SUCCESS[1], labels=(*LABELS, "finished_reason"))
        for labels, stats in self.series:
            for reason, count in sorted(stats.get("finished_requests", {}).items()):
                success.add_metric((*labels, reason), float(count))
        yield success
        for name, help_text in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + name, help_text, labels=LABELS)
            for labels, stats in self.series:
                histogram = stats.get("histograms", {}).get(name)
                if histogram is not None:
                    family.add_metric(labels, cumulative_buckets(histogram), histogram["sum"])
            yield family

    def _fill(self, family: Metric, key: str) -> Metric:
        for labels, stats in self.series:
            if key in stats:
                family.add_metric(labels, float(stats[key]))
        return family


def cumulative_buckets(histogram: Mapping) -> list[tuple[str, float]]:
    """engine.metrics.Histogram.as_dict() (a count per bucket, +Inf last) as Prometheus's
    cumulative (le, count) pairs."""
    bounds: Iterable[float] = (*histogram["buckets"], float("inf"))
    if len(histogram["counts"]) != len(histogram["buckets"]) + 1:
        raise ValueError(f"a histogram needs one count per bucket and one for +Inf, got "
                         f"{len(histogram['counts'])} counts for {len(histogram['buckets'])} buckets")
    pairs, total = [], 0
    for bound, count in zip(bounds, histogram["counts"]):
        total += count
        pairs.append((floatToGoString(bound), float(total)))
    return pairs


def prometheus_text(stats_by_replica: Mapping[str, Mapping], model_name: str) -> str:
    """Prometheus text format (0.0.4) for the stats of every replica, labelled by replica."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineStatsCollector(stats_by_replica, model_name))
    return generate_latest(registry).decode()
