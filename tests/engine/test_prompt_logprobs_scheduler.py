"""Prompt logprobs in the scheduler, over a model-free runner whose entry for prompt position p is
{token: (-p, 1)}: gathered chunk by chunk, each position once across a preemption (the recomputation
starts from the first token, not from a prefix-cache hit, and what it computes again is skipped),
sent once with the first output after they are complete, and not at all without prompt_logprobs."""

from __future__ import annotations

from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.fakes import EOS, FakeRunner
from tests.engine.test_scheduler import make_scheduler

PROMPT = list(range(1, 31))  # 30 tokens: 7 full blocks of 4


class PromptLogprobsRunner(FakeRunner):
    """FakeRunner that also answers prompt logprobs as a worker does: for every scheduled position p
    below the prompt's last, an entry for prompt token p + 1."""

    def execute_model(self, so, fail=None):
        starts = {d.req_id: d.num_computed_tokens for d in [*so.scheduled_new_reqs, *so.scheduled_cached_reqs]}
        out = super().execute_model(so, fail)
        for req_id, n in so.num_scheduled_tokens.items():
            first, end = starts[req_id], min(starts[req_id] + n, len(PROMPT) - 1)
            if req_id.startswith("lp") and end > first:
                out.prompt_logprobs[req_id] = (first, [{PROMPT[p + 1]: (-float(p + 1), 1)} for p in range(first, end)])
        return out


def request(request_id: str, prompt_logprobs: int | None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return Request(request_id, list(PROMPT), params, eos_token_ids=frozenset({EOS}), block_size=4, max_tokens=2)


EXPECTED = [None] + [{PROMPT[p]: (-float(p), 1)} for p in range(1, len(PROMPT))]


def test_gathered_across_chunks_and_a_preemption_each_position_once():
    sched, runner = make_scheduler(budget=8), PromptLogprobsRunner()
    sched.add_request(request("plain", None))  # computes the prompt's blocks into the prefix cache
    while sched.has_unfinished_requests():
        sched.update_from_output(so := sched.schedule(), runner.execute_model(so))
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (30, 0)
    lp = request("lp", 0)
    sched.add_request(lp)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit: its logits are needed
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (30, 0)  # nor a lookup
    sched.update_from_output(so, runner.execute_model(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"lp": 8} and sched.update_from_output(so, runner.execute_model(so)) == []
    assert lp.prompt_logprobs == EXPECTED[:17]
    sched.running.remove(lp)
    sched._preempt(lp)  # the pool ran short: recomputed from the first token
    outputs = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if "lp" in {d.req_id for d in so.scheduled_new_reqs}:
            assert so.scheduled_new_reqs[0].num_computed_tokens == 0
        outputs += sched.update_from_output(so, runner.execute_model(so))
    assert [o.prompt_logprobs for o in outputs] == [EXPECTED, None]
    assert lp.prompt_logprobs == EXPECTED


def test_a_complete_request_takes_prefix_hits_again_and_k_none_sends_nothing():
    sched, runner = make_scheduler(budget=64), PromptLogprobsRunner()
    done = request("lp-done", 1)
    done.prompt_logprobs = list(EXPECTED)  # complete: e.g. a request recomputed after its prefill
    sched.add_request(request("plain", None))
    outputs = []
    while sched.has_unfinished_requests():
        outputs += sched.update_from_output(so := sched.schedule(), runner.execute_model(so))
    assert all(o.prompt_logprobs is None for o in outputs)
    sched.add_request(done)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 28  # 7 blocks of the cache
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (60, 28)
