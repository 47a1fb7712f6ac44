"""A worker killed by pid mid-generation: detected within seconds, the group rebuilt, every request
completed with the tokens it would have produced, no block leaked."""

from __future__ import annotations

import os
import signal
import time

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def run_to_completion(core, finals):
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids


def test_killed_worker_is_replaced_and_requests_complete(ray_cluster, model_dirs):
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"]) as reference:
        expected = [o.outputs[0].token_ids for o in reference.generate(
            [{"prompt_token_ids": p} for p in prompts], PARAMS)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    with LLM(model=model_dirs["llama"], tensor_parallel_size=2) as llm:
        core = llm.core
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, PARAMS)
        core.add_request("seeded", prompts[2], seeded)
        finals: dict[str, list[int]] = {}
        for _ in range(6):
            for out in core.step():
                assert not out.finished
        old_pids = core.executor.worker_pids()
        detected_at = []
        restart = core.executor.restart
        core.executor.restart = lambda: (detected_at.append(time.monotonic()), restart())[1]
        killed_at = time.monotonic()
        os.kill(old_pids[1], signal.SIGKILL)
        run_to_completion(core, finals)
        stats = llm.stats()
        new_pids = core.executor.worker_pids()
        # the seeded sample, rerun without a failure, gives the same tokens
        core.add_request("seeded-again", prompts[2], seeded)
        run_to_completion(core, finals)
    assert detected_at and detected_at[0] - killed_at < 5.0, "the dead worker was not noticed within 5 s"
    assert stats["num_worker_restarts"] == 1
    assert not set(new_pids) & set(old_pids)
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert finals["seeded"] == finals["seeded-again"]
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0


def test_an_exception_inside_a_rank_fails_its_request_alone_without_a_rebuild(ray_cluster, model_dirs):
    """A request whose parameters were changed after admission (past the vocabulary) makes rank 0's
    sampler raise IndexError: the rank is alive, so nothing is rebuilt; that request fails alone and
    the others produce the tokens they would have."""
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"]) as reference:
        expected = [o.outputs[0].token_ids for o in reference.generate(
            [{"prompt_token_ids": p} for p in prompts], PARAMS)]
    with LLM(model=model_dirs["llama"], tensor_parallel_size=2) as llm:
        core = llm.core
        old_pids = core.executor.worker_pids()
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, PARAMS)
        bad = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, min_tokens=5)
        core.add_request("bad", prompts[1], bad)
        bad.stop_token_ids = [10**6]  # after admission: what validation would have refused
        finals: dict[str, list[int]] = {}
        failed = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
                    failed[out.request_id] = out.error
        stats = llm.stats()
        assert core.executor.worker_pids() == old_pids
    assert failed["bad"] == "the engine failed while running this request (IndexError)"
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert stats["num_worker_restarts"] == 0
    assert stats["num_failed_requests"] == 1 and stats["num_failed_steps"] == 2
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
