"""Request ids: the engine's ids of the n samples of a request live in their own namespace (no
client id can collide with them), and a duplicate id is refused before anything is registered."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.test_engine_failures import FakeExecutor, make_core, run

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_client_id_that_looks_like_a_sample_id_does_not_collide(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    core.add_request("X", [5, 6, 7], SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    core.add_request("X#0", [8, 9], PARAMS)
    core.add_request("X#1#0", [10, 11], PARAMS)
    finals = run(core)
    assert set(finals) == {"X", "X#0", "X#1#0"}
    assert [len(s.token_ids) for s in finals["X"].outputs] == [4, 4]
    assert [s.finish_reason for s in finals["X"].outputs] == ["length", "length"]
    assert len(finals["X#0"].outputs) == 1 and len(finals["X#0"].outputs[0].token_ids) == 4
    assert core.stats()["num_blocks_in_use"] == 0 and not core.outputs.requests


@pytest.mark.parametrize("n", [1, 3])
def test_a_duplicate_id_is_refused_and_leaks_nothing(model_dirs, n):
    core = make_core(model_dirs, FakeExecutor())
    core.add_request("A", [5, 6, 7], SamplingParams(n=n, temperature=0.0, max_tokens=4, ignore_eos=True))
    core.step()
    sched_before = dict(core.scheduler.requests)
    samples_before = dict(core.outputs._by_sample_id)
    with pytest.raises(ValueError, match="request id 'A' is already in use"):
        core.add_request("A", [9, 9], PARAMS)
    assert core.scheduler.requests == sched_before and core.outputs._by_sample_id == samples_before
    finals = run(core)
    assert set(finals) == {"A"} and all(len(s.token_ids) == 4 for s in finals["A"].outputs)
    assert core.stats()["num_blocks_in_use"] == 0 and not core.outputs._by_sample_id


@pytest.mark.parametrize("bad", ["", None, 7])
def test_a_request_id_must_be_a_non_empty_string(model_dirs, bad):
    core = make_core(model_dirs, FakeExecutor())
    with pytest.raises(ValueError, match="non-empty string"):
        core.add_request(bad, [5, 6], PARAMS)
    assert not core.outputs.requests and not core.scheduler.requests
