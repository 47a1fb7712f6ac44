"""EngineCore over a model-free executor: a lost rank is rebuilt a bounded number of times, an
exception inside a rank rebuilds nothing and fails only the request it came from."""

from __future__ import annotations

import pytest

from engine import AsyncLLM, SamplingParams
from engine.core import EngineCore, EngineDeadError
from engine.executor import Executor, StepFailedError, WorkerFailedError
from engine.llm import engine_config
from api.metrics import prometheus_text
from tests.engine.fakes import FakeRunner

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class FakeExecutor(Executor):
    """FakeRunner behind the Executor interface. ``die_on``: call numbers (1-based) on which a rank
    is lost; ``raise_for``: a request id prefix; a step holding a request whose id starts with it makes
    a rank raise (alive)."""

    def __init__(self, die_on=(), raise_for: str | None = None) -> None:
        self.runner = FakeRunner()
        self.die_on, self.raise_for = set(die_on), raise_for
        self.calls = self.restarts = 0

    def determine_num_kv_blocks(self) -> int:
        return 64

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so):
        self.calls += 1
        if self.calls in self.die_on or "always" in self.die_on:
            raise WorkerFailedError("rank 1 died")
        if self.raise_for is not None and any(s.startswith(self.raise_for) for s in so.num_scheduled_tokens):
            self.runner.execute_model(so)  # the ranks applied the step before one of them raised
            raise StepFailedError("IndexError", "index 9999 is out of bounds")
        return self.runner.execute_model(so)

    def restart(self) -> None:
        self.restarts += 1
        self.runner = FakeRunner()


def make_core(model_dirs, executor, **kwargs) -> EngineCore:
    config = engine_config(model_dirs["llama"], num_kv_blocks=64, block_size=4, max_model_len=128,
                           worker_restart_backoff_s=0.0, **kwargs)
    return EngineCore(config, executor=executor)


def run(core) -> dict:
    finals = {}
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def reference_tokens(model_dirs, prompts) -> dict:
    core = make_core(model_dirs, FakeExecutor())
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, PARAMS)
    return {k: v.outputs[0].token_ids for k, v in run(core).items()}


PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10, 11], [20, 21]]


def test_a_lost_rank_is_rebuilt_and_the_requests_complete(model_dirs):
    expected = reference_tokens(model_dirs, PROMPTS)
    executor = FakeExecutor(die_on={2, 4})
    core = make_core(model_dirs, executor)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    finals = run(core)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert executor.restarts == 2 and core.stats()["num_worker_restarts"] == 2
    assert "kvserve:worker_restarts_total{" in prometheus_text({"0": core.stats()}, "m")
    assert 'kvserve:worker_restarts_total{model_name="m",replica="0"} 2.0' in \
        prometheus_text({"0": core.stats()}, "m")


def test_a_rank_lost_after_every_rebuild_ends_in_engine_dead_not_a_loop(model_dirs):
    executor = FakeExecutor(die_on={"always"})
    core = make_core(model_dirs, executor, max_worker_restarts=3)
    core.add_request("r0", PROMPTS[0], PARAMS)
    for _ in range(3):
        assert core.step() == []
    with pytest.raises(EngineDeadError, match="after 3 restarts"):
        core.step()
    assert executor.restarts == 3 and core.stats()["num_worker_restarts"] == 3
    # dead for good: no further rebuild is tried, and new requests are refused at once
    with pytest.raises(EngineDeadError):
        core.step()
    assert executor.restarts == 3 and executor.calls == 4
    with pytest.raises(EngineDeadError, match="gives up"):
        AsyncLLM(core.config, core=core).submit("r1", PROMPTS[1], PARAMS, lambda item: None)


def test_rebuilds_outside_the_window_do_not_count(model_dirs, monkeypatch):
    import engine.core

    clock = [1000.0]
    monkeypatch.setattr(engine.core.time, "monotonic", lambda: clock[0])
    executor = FakeExecutor(die_on={"always"})
    core = make_core(model_dirs, executor, max_worker_restarts=1, worker_restart_window_s=60.0)
    core.add_request("r0", PROMPTS[0], PARAMS)
    core.step()
    clock[0] += 61.0
    core.step()  # the first rebuild left the window: this one is allowed
    assert executor.restarts == 2
    with pytest.raises(EngineDeadError):
        core.step()


def test_the_second_rebuild_in_the_window_backs_off(model_dirs, monkeypatch):
    import engine.core

    slept = []
    monkeypatch.setattr(engine.core.time, "sleep", slept.append)
    config = engine_config(model_dirs["llama"], num_kv_blocks=64, block_size=4, max_model_len=128, worker_restart_backoff_s=0.5)
    core = EngineCore(config, executor=FakeExecutor(die_on={"always"}))
    core.add_request("r0", PROMPTS[0], PARAMS)
    for _ in range(3):
        core.step()
    assert slept == [0.5, 1.0]


def test_an_exception_inside_a_rank_rebuilds_nothing_and_fails_its_request_alone(model_dirs):
    expected = reference_tokens(model_dirs, PROMPTS)
    executor = FakeExecutor(raise_for="bad")
    core = make_core(model_dirs, executor)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    core.add_request("bad", PROMPTS[0], PARAMS)
    finals = run(core)
    assert finals["bad"].error == "the engine failed while running this request (IndexError)"
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k != "bad"} == expected
    stats = core.stats()
    assert executor.restarts == 0 and stats["num_worker_restarts"] == 0
    assert stats["num_failed_steps"] == 2 and stats["num_failed_requests"] == 1
    assert stats["num_blocks_in_use"] == 0


def test_a_request_whose_output_cannot_be_made_fails_alone(model_dirs):
    """The detokenizer of one request raises: that request ends with an error, its blocks freed; the
    others (in the same steps) produce their tokens."""
    expected = reference_tokens(model_dirs, PROMPTS)
    core = make_core(model_dirs, FakeExecutor())
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    core.add_request("bad", PROMPTS[0], PARAMS)
    core.step()
    _, sample = core.outputs._by_sample_id["bad#0"]

    def broken(*args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    sample.detokenizer.update = broken
    finals = run(core)
    assert finals["bad"].error == "the engine failed while running this request (UnicodeDecodeError)"
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k != "bad"} == expected
    stats = core.stats()
    assert stats["num_failed_requests"] == 1 and stats["num_failed_steps"] == 0
    assert stats["num_blocks_in_use"] == 0 and not core.outputs.requests
