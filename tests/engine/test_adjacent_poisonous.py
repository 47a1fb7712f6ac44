"""Poisonous requests that arrive together sit side by side in the queue of suspects, so their
steps alone fail in a row like the steps of broken ranks. A probe (a request that produced tokens,
alone) runs: it succeeds, so each poisonous request fails alone and nothing is rebuilt."""

from __future__ import annotations

import pytest

from tests.engine.test_engine_failures import (
    PARAMS,
    PROMPTS,
    FakeExecutor,
    make_core,
    reference_tokens,
    run,
)


@pytest.mark.parametrize("num_bad", [3, 5])
def test_adjacent_poisonous_requests_fail_alone_and_rebuild_nothing(model_dirs, num_bad):
    expected = reference_tokens(model_dirs, PROMPTS)
    executor = FakeExecutor(raise_for="bad")
    core = make_core(model_dirs, executor, max_consecutive_failed_steps=3, max_worker_restarts=1)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    finals = {out.request_id: out for out in core.step() if out.finished}  # the good ones run first
    for n in range(num_bad):  # then the poisonous ones arrive together
        core.add_request(f"bad{n}", PROMPTS[n % 3], PARAMS)
    finals.update(run(core))
    assert executor.restarts == 0 and core.dead is None
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k.startswith("r")} == expected
    for n in range(num_bad):
        assert finals[f"bad{n}"].error == "the engine failed while running this request (IndexError)"
    stats = core.stats()
    assert stats["num_worker_restarts"] == 0 and stats["num_failed_requests"] == num_bad
    assert stats["num_blocks_in_use"] == 0
