"""Latency histograms: time to first token once per request, inter-token latency per sample (never
the zero gap between two samples of one request that advanced in the same step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import engine.output_processor
from engine import SamplingParams
from tests.engine.test_engine_failures import FakeExecutor, make_core, run


@pytest.mark.parametrize("n", [1, 3])
def test_inter_token_latency_has_one_positive_gap_per_token_after_each_samples_first(model_dirs, monkeypatch, n):
    clock = [1024.0]
    step = 1 / 64  # exact in binary: every gap is exactly one step

    def tick():  # every step's outputs one step after the last
        clock[0] += step
        return clock[0]

    monkeypatch.setattr(engine.output_processor, "time", SimpleNamespace(time=tick))
    core = make_core(model_dirs, FakeExecutor())
    max_tokens = 5
    core.add_request("a", [5, 6, 7, 8, 9], SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens,
                                                           ignore_eos=True), arrival_time=1024.0)
    finals = run(core)
    assert [len(s.token_ids) for s in finals["a"].outputs] == [max_tokens] * n
    hist = core.stats()["histograms"]
    itl, ttft = hist["inter_token_latency_seconds"], hist["time_to_first_token_seconds"]
    assert ttft["count"] == 1
    assert itl["count"] == n * (max_tokens - 1)
    buckets = itl["buckets"]
    # every gap is one step (15.6 ms): all land in the (0.01, 0.02] bucket, none in the lowest
    assert itl["counts"][buckets.index(0.02)] == itl["count"]
    assert itl["sum"] == step * itl["count"]
