"""The Hugging Face peers of the benchmark on smoke-sized workloads: exact token counts, sane per-request
timings, multi-turn rounds that wait for each other, and the same greedy tokens from both peers."""

from __future__ import annotations

import pytest

from benchmarks import hf_peer
from benchmarks.records import summarize
from benchmarks.workloads import mixed, multi_turn, shared_system_prompt

# Continuous batching sized for the smoke test: HF's default cache on CPU is sized from the machine's
# memory, with an attention mask whose allocation alone takes seconds. 16-token pages let the shared
# system prompt actually use HF's prefix sharing.
SMALL_CB = dict(page_size=16, num_blocks=64, max_batch_tokens=256)


@pytest.fixture(scope="module")
def runs(model_dirs):
    """workload name -> (workload, {peer: (summary, records)}), records captured from the summaries."""
    d = model_dirs["llama"]
    workloads = [
        shared_system_prompt(d, num_requests=4, system_chars=200, user_len=8, output_len=4),
        multi_turn(d, num_users=2, num_turns=2, system_len=16, user_len=8, reply_len=8, output_len=4),
        mixed(d, num_requests=4, prompt_range=(4, 40), output_range=(2, 8)),
    ]
    captured = []

    def capture(name, records, elapsed_s, **extra):
        captured.append(records)
        return summarize(name, records, elapsed_s, **extra)

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_peer, "summarize", capture)
        for workload in workloads:
            finished = []
            static = hf_peer.run_hf_static(d, workload, batch_size=2, progress=finished.append)
            static_records = captured[-1]
            continuous = hf_peer.run_hf_continuous(d, workload, progress=finished.append, **SMALL_CB)
            assert sum(finished) == 2 * len(workload.requests)
            out[workload.name] = (workload, {"static": (static, static_records),
                                             "continuous": (continuous, captured[-1])})
    return out


@pytest.mark.parametrize("workload_name", ["shared-system-prompt", "multi-turn", "mixed"])
@pytest.mark.parametrize("peer", ["static", "continuous"])
def test_counts_and_timings(runs, workload_name, peer):
    workload, by_peer = runs[workload_name]
    summary, records = by_peer[peer]
    expected = sum(r.output_len for r in workload.requests)
    assert summary["num_requests"] == len(workload.requests) and summary["num_failed"] == 0
    assert summary["output_tokens"] == expected
    assert summary["requests_per_s"] > 0
    assert summary["itl_s"]["count"] == expected - len(workload.requests)
    assert [len(ids) for ids in summary["token_ids"]] == [r.output_len for r in workload.requests]
    for request, record, token_ids in zip(workload.requests, records, summary["token_ids"]):
        assert record.prompt_tokens == len(request.prompt) and record.token_ids == token_ids
        assert record.ttft > 0 and record.e2e >= record.ttft
        assert record.end == record.chunk_times[-1]
    if peer == "continuous":
        assert summary["attn_implementation"] == "sdpa"


@pytest.mark.parametrize("peer", ["static", "continuous"])
def test_multi_turn_waits_for_the_previous_turn(runs, peer):
    workload, by_peer = runs["multi-turn"]
    records = by_peer[peer][1]
    for later, earlier in workload.predecessor().items():
        assert records[later].arrival >= records[earlier].end


def test_peers_agree_on_greedy_tokens(runs, hf_oracle):
    workload, by_peer = runs["shared-system-prompt"]
    static, continuous = (by_peer[p][0]["token_ids"] for p in ("static", "continuous"))
    oracle = hf_oracle("llama")
    for request, tokens in zip(workload.requests, static):
        oracle.assert_greedy(request.prompt, tokens)
    assert static == continuous
