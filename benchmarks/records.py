"""What every benchmark run records, whoever served it: one RequestRecord per request (times from
``time.perf_counter()``), summarised the same way for kvserve, the Serve path and the peers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import math


@dataclass
class RequestRecord:
    prompt_tokens: int
    arrival: float  # when the request was sent (or, offline, became eligible to run)
    chunk_times: list[float] = field(default_factory=list)  # when each batch of output tokens became visible
    chunk_tokens: list[int] = field(default_factory=list)  # how many tokens each of those carried
    end: float | None = None
    cached_tokens: int | None = None  # prompt tokens served from a prefix cache, where the server says
    error: str | None = None
    token_ids: list[int] | None = None  # kept by offline runs to compare systems

    def add_tokens(self, count: int, at: float) -> None:
        if count > 0:
            self.chunk_times.append(at)
            self.chunk_tokens.append(count)

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.arrival if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    def to_dict(self) -> dict:
        """Plain JSON data (the form a benchmark process sends back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RequestRecord:
        return cls(**{k: data[k] for k in data if k in cls.__dataclass_fields__})

    def inter_token_latencies(self) -> list[float]:
        """One sample per token after the first chunk: the gap before its chunk spread over the
        chunk's tokens (a chunk of k tokens that came 30 ms after the last one counts k x 30/k ms)."""
        gaps = []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            gaps.extend([(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k)
        return gaps


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99 (nearest rank on the sorted values), mean and count; zeros when empty."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "count": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99), "mean": sum(ordered) / len(ordered),
            "count": len(ordered)}


def summarize(name: str, records: list[RequestRecord], elapsed_s: float, **extra) -> dict:
    """A run's report: throughput over the whole run and latency distributions over its requests.
    ``extra`` adds fields the system knows about itself (hit rate, KV usage, preemptions, ...)."""
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    result = {
        "name": name,
        "num_requests": len(records),
        "num_failed": len(records) - len(done),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "requests_per_s": len(done) / elapsed_s if elapsed_s > 0 else 0.0,
        "ttft_s": percentiles(ttfts),
        "itl_s": percentiles([g for r in done for g in r.inter_token_latencies()]),
        "e2e_s": percentiles([r.e2e for r in done if r.e2e is not None]),
        "ttft_samples_s": ttfts,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    result.update(extra)
    return result
