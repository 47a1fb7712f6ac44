"""Pipeline parallelism when a step fails: a request that raises with steps in flight or before the first
stage sends its activations fails alone, the others' tokens unchanged; the step's cause is the earliest
stage's error; a compiled step whose read was interrupted is lost, not a dead rank."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.cluster.conftest import count_in_flight, generate
from tests.e2e.prompts import test_prompts as make_prompts


def prompts_and_expected(path: str) -> tuple[list, SamplingParams, list]:
    """The test prompts, greedy sampling of 12 tokens, and the tokens one process makes for them."""
    prompts = make_prompts(path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=path, num_kv_blocks=256) as reference:
        return prompts, params, generate(reference, prompts, params)


def run_to_the_end(core) -> tuple[dict, dict]:
    """Step the engine until every request finished: each request's final tokens and error."""
    finals, failed = {}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id], failed[out.request_id] = out.outputs[0].token_ids, out.error
    return finals, failed


@pytest.mark.parametrize("dispatch", ["remote", "compiled"])
def test_a_request_that_raises_with_steps_in_flight_fails_alone(ray_cluster, five_layers, dispatch):
    """A request whose stop ids were changed after admission (past the vocabulary) makes the last
    stage's sampler raise while another step is in flight: the steps out are drained, the ranks rebuilt
    and the running requests recomputed; steps then run one at a time, where the request fails alone.
    The others produce the tokens of a run without it."""
    path, _ = five_layers
    prompts, params, expected = prompts_and_expected(path)
    with LLM(model=path, pipeline_parallel_size=2, num_kv_blocks=256, tp_dispatch=dispatch) as llm:
        core = llm.core
        counts = count_in_flight(llm)
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        bad = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=5)
        core.add_request("bad", prompts[1], bad)
        bad.stop_token_ids = [10**6]  # after admission: what validation would have refused
        finals, failed = run_to_the_end(core)
        stats = llm.stats()
    assert max(counts) == 2
    assert failed["bad"] == "the engine failed while running this request (IndexError)"
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert stats["num_worker_restarts"] == 1 and stats["num_failed_requests"] == 1
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0


def test_a_compiled_step_whose_read_was_interrupted_is_lost_not_a_dead_rank(monkeypatch):
    """A compiled graph's answers can be read once: a read cut by an interruption (or a timeout) loses
    them. Collecting that step again raises RuntimeError (the engine rebuilds the ranks, not held
    against the budget), not the WorkerFailedError of a lost rank; a step read whole answers with the
    sampling rank's output."""
    import cluster.worker_group as worker_group
    from cluster.worker_group import WorkerGroup, _CompiledStep
    from engine.executor import WorkerFailedError

    reads = []

    def get(refs, timeout=None):
        reads.append(refs)
        if isinstance(refs[-1], BaseException):
            raise refs[-1]
        return refs

    monkeypatch.setattr(worker_group.ray, "get", get)
    group = object.__new__(WorkerGroup)
    group.step_timeout_s, group.stage_ranks, group.output_rank = 5.0, [0, 1], 1
    group.pipeline = type("Times", (), {"add": lambda self, *a: None})()
    cut = _CompiledStep(["stage 0", KeyboardInterrupt()])
    with pytest.raises(KeyboardInterrupt):
        group.collect(cut)
    with pytest.raises(RuntimeError, match="its read was interrupted") as lost:
        group.collect(cut)
    assert not isinstance(lost.value, WorkerFailedError) and len(reads) == 1
    assert group.collect(_CompiledStep(["stage 0", "answer"])) == "answer"
    with pytest.raises(WorkerFailedError, match="a tensor-parallel rank failed"):
        group.collect(_CompiledStep(["stage 0", TimeoutError("no answer")]))


def test_a_compiled_step_fails_with_the_earliest_error_that_is_not_an_echo(monkeypatch):
    """Through the compiled graph a rank answers what it raised (``RankRaised``): every rank's answer is
    read, and the step fails with the earliest rank's error that is not a later stage's
    ``UpstreamStageFailed`` echo, in whatever order the answers stand; only echoes: the first of them."""
    import cluster.worker_group as worker_group
    from cluster.worker_group import WorkerGroup, _CompiledStep
    from engine.executor import RankRaised, StepFailedError

    monkeypatch.setattr(worker_group.ray, "get", lambda refs, timeout=None: refs)
    group = object.__new__(WorkerGroup)
    group.step_timeout_s, group.stage_ranks, group.output_rank = 5.0, [0, 2], 2
    group.pipeline = type("Times", (), {"add": lambda self, *a: None})()
    echo = RankRaised("UpstreamStageFailed", "pipeline stage 0 failed this step before sending its activations")
    index = RankRaised.of(IndexError("index out of range in self\nmore lines"))
    assert index == RankRaised("IndexError", "index out of range in self") and echo.upstream and not index.upstream
    for answers in ([echo, index, echo], [index, echo, echo], ["stage 0", index, None]):
        with pytest.raises(StepFailedError, match="^IndexError: index out of range in self$") as failed:
            group.collect(_CompiledStep(list(answers)))
        assert failed.value.kind == "IndexError" and not failed.value.ranks_stuck
    with pytest.raises(StepFailedError, match="^UpstreamStageFailed: "):
        group.collect(_CompiledStep([None, echo, echo]))


def test_after_a_raise_the_step_fails_with_the_earliest_stages_error_or_the_group_is_wedged(ray_cluster):
    """``WorkerGroup._after_raise`` on real Ray answers, one rank per stage: every rank answered (the
    later stage with ``UpstreamStageFailed``, read first) is a failed step whose cause is the first stage's
    error; a later stage that never answers is a failed step with stuck ranks (a stage raised before it
    could tell the next one); an earlier stage that never answers is a wedged group."""
    from types import SimpleNamespace

    import ray

    from cluster.worker_group import WorkerGroup
    from engine.executor import StepFailedError, UpstreamStageFailed, WorkerFailedError

    @ray.remote(max_retries=0)
    def rank(error: str | None, sleep_s: float = 0.0):
        import time as _time

        _time.sleep(sleep_s)
        if error == "index":
            raise IndexError("index out of range in self")
        if error == "value":
            raise ValueError("a later stage's own error")
        if error == "upstream":
            raise UpstreamStageFailed("pipeline stage 0 failed this step before sending its activations")
        return "ok"

    group = object.__new__(WorkerGroup)
    group.config = SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=1))
    upstream = UpstreamStageFailed("pipeline stage 0 failed this step")
    refs = [rank.remote("index"), rank.remote("upstream")]
    ray.wait(refs, num_returns=2)
    with pytest.raises(StepFailedError) as failed:
        group._after_raise(refs, upstream)
    assert failed.value.kind == "IndexError" and not failed.value.ranks_stuck
    # the earliest stage's error is the cause even where a later stage's own error was seen first
    refs = [rank.remote("index"), rank.remote("value"), rank.remote("upstream")]
    ray.wait(refs, num_returns=3)
    with pytest.raises(StepFailedError) as failed:
        group._after_raise(refs, ValueError("a later stage's own error"))
    assert failed.value.kind == "IndexError"
    stuck = [rank.remote("index"), rank.remote(None, 600)]
    wedged = [rank.remote(None, 600), rank.remote("index")]
    try:
        ray.wait([stuck[0], wedged[1]], num_returns=2)  # (the raising ranks have answered)
        with pytest.raises(StepFailedError) as failed:
            group._after_raise(stuck, IndexError("index out of range in self"))
        assert failed.value.kind == "IndexError" and failed.value.ranks_stuck
        with pytest.raises(WorkerFailedError, match="ranks \\[0\\] did not finish"):
            group._after_raise(wedged, IndexError("index out of range in self"))
    finally:
        for ref in (stuck[1], wedged[0]):
            ray.cancel(ref, force=True)


@pytest.mark.parametrize("dispatch", ["remote", "compiled"])
def test_a_first_stage_that_raises_before_sending_holds_nothing_up(ray_cluster, five_layers, dispatch, caplog):
    """A prompt token past the vocabulary (set after admission, where validation would have refused it)
    makes the first stage's embedding raise before it sends its activations. It tells the second stage
    so (a status word before every step's activations), which raises in turn instead of waiting for them
    (until gloo's timeout, 120 s): every rank answers, the step fails with the first stage's error, and
    the request fails alone while the others produce the tokens of a run without it, the ranks never
    rebuilt, through actor calls and through the compiled graph alike. (Before, the waiting stage read
    as a dead rank: three budgeted rebuilds, then the engine gave up.)"""
    import time

    path, _ = five_layers
    prompts, params, expected = prompts_and_expected(path)
    # one step in flight: a step that raises beside another in flight rebuilds the ranks anyway (that is
    # test_a_request_that_raises_with_steps_in_flight_fails_alone's)
    with LLM(model=path, pipeline_parallel_size=2, batches_in_flight=1, num_kv_blocks=256,
             tp_dispatch=dispatch) as llm:
        core = llm.core
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        core.add_request("bad", prompts[1][::-1], params)  # no prefix shared with the others
        core.scheduler.requests["bad#0"].all_token_ids[-1] = 10**6  # the last prompt token is always computed
        began = time.monotonic()
        finals, failed = run_to_the_end(core)
        took = time.monotonic() - began
        stats = llm.stats()
    assert failed["bad"] is not None and "IndexError" in failed["bad"]
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
    assert stats["num_failed_requests"] == 1 and stats["num_worker_restarts"] == 0 and took < 60
    # the failed steps' cause, logged, is the first stage's error, never the second stage's echo of it
    failures = [r.getMessage() for r in caplog.records if "engine step" in r.getMessage()]
    assert failures and all("IndexError" in m and "UpstreamStageFailed" not in m for m in failures)


class _UnreadableIn:
    """Unpickles to None, except in the process ``pid``, where unpickling raises ZeroDivisionError (a plan
    one rank cannot read: a class or module its code version lacks, memory it cannot get)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self):
        return eval, (f"1 / 0 if __import__('os').getpid() == {self.pid} else None",)


@pytest.mark.parametrize("dispatch", ["remote", "compiled"])
def test_a_plan_the_first_stage_cannot_read_fails_the_step_with_the_links_in_step(ray_cluster, five_layers,
                                                                                dispatch, caplog):
    """One step's plan cannot be unpickled by the first stage's rank alone. The rank reads it inside its
    step, so the step fails there like any other error: the second stage is told (no wait for
    activations until gloo's timeout, 120 s), every rank answers, the step fails with the first stage's
    error and its requests run again, producing the tokens of a run without the fault, the ranks never
    rebuilt. (When Ray read the plan before the call, the first stage's call failed before the
    pipeline's protocol ran: through the compiled graph the second stage waited for activations.)"""
    import time

    path, _ = five_layers
    prompts, params, expected = prompts_and_expected(path)
    with LLM(model=path, pipeline_parallel_size=2, batches_in_flight=1, num_kv_blocks=256,
             tp_dispatch=dispatch) as llm:
        core = llm.core
        group = core.executor.group
        first_stage_pid = group.pids()[0]
        submit, sent = group.submit, []

        def submit_one_unreadable(scheduler_output):
            sent.append(scheduler_output.step_id)
            if len(sent) == 3:  # a step with requests prefilled and decoding
                scheduler_output.unreadable = _UnreadableIn(first_stage_pid)
            return submit(scheduler_output)

        group.submit = submit_one_unreadable
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        began = time.monotonic()
        finals, failed = run_to_the_end(core)
        took = time.monotonic() - began
        stats = llm.stats()
    assert len(sent) > 3 and took < 60
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert all(error is None for error in failed.values())
    assert stats["num_worker_restarts"] == 0 and stats["num_failed_requests"] == 0
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
    failures = [r.getMessage() for r in caplog.records if "engine step" in r.getMessage()]
    assert len(failures) == 1 and "ZeroDivisionError" in failures[0] and "UpstreamStageFailed" not in failures[0]
