"""What the engine does when a step fails: the mixin of ``EngineCore`` that rolls back, isolates
the request at fault, fails it alone, and rebuilds the ranks (or gives up on them).

- A plan that raises (``Scheduler.schedule`` undid it): it is planned again whole once; raising
  again, its requests run one per step; the one whose plan raises alone fails alone (``_plan_failed``).
- A step that raises inside the ranks (rolled back): the same search (``_isolate``); many steps of
  one request failing in a row, then a probe (another request alone) failing too, mean broken
  ranks (``_ranks_look_broken``), rebuilt by ``_recover``.
- A lost rank: ``_recover`` rebuilds the ranks within the restart budget, then the engine is dead.
- The outputs of a step that ran raise: ``_outputs_failed`` ends the step's unfinished requests with
  an error, so none waits forever and no block stays held.
"""

from __future__ import annotations

import logging
import time

from engine.executor import StepFailedError, WorkerFailedError
from engine.messages import RequestOutput
from engine.request import RequestStatus

logger = logging.getLogger("engine.core")


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more (its workers are gone); requests in flight fail with it."""


class RequestFailedError(RuntimeError):
    """The engine could not run this request (a step that held it alone raised); others go on."""


class StepFailures:
    """Mixed into ``EngineCore``: uses its scheduler, outputs, executor, config, lock and counters."""

    def _next_suspect(self) -> str | None:
        while self._suspects and self._suspects[0] not in self.scheduler.requests:
            self._suspects.popleft()  # finished or aborted meanwhile
        return self._suspects[0] if self._suspects else None

    def _ranks_look_broken(self, scheduler_output, exc: Exception) -> bool | None:
        """Count a step of one request that raised (a larger step that raises only starts the search
        for the request at fault). ``max_consecutive_failed_steps`` of them in a row (no step ran
        between), each with a different request, may be broken ranks (a sticky device fault, a
        corrupted rank) or poisonous requests that were adjacent in the queue. A probe tells them
        apart: another request (one that has produced tokens first) runs alone next, then the one
        that failed. The probe runs: the ranks are fine and the count starts again (the failed one
        then fails alone). The probe fails too, or there is none to run: the ranks are broken and
        are rebuilt (``_recover``), True. None: a probe is under way (nothing fails now); False:
        fail the request alone (``_isolate``)."""
        if len(scheduler_output.num_scheduled_tokens) != 1:
            return False
        self._failed_in_a_row += 1
        self._failed_in_a_row_samples.update(scheduler_output.num_scheduled_tokens)
        if (self._failed_in_a_row < self.config.max_consecutive_failed_steps
                or len(self._failed_in_a_row_samples) < 2):
            return False
        failed = next(iter(scheduler_output.num_scheduled_tokens))
        probe = None if self._probe_id is not None else self._probe_candidate()
        if probe is not None:
            self._probe_id = probe
            self.num_failed_steps += 1
            logger.warning("%d engine steps failed in a row with %d different requests; running another "
                           "request alone to tell broken ranks from requests at fault", self._failed_in_a_row,
                           len(self._failed_in_a_row_samples))
            for sample_id in (probe, failed):
                if sample_id in self._suspects:
                    self._suspects.remove(sample_id)
            self._suspects.extendleft((failed, probe))  # the probe first, then the one that failed
            return None
        self._probe_id = None
        self.num_failed_steps += 1
        logger.error("%d engine steps failed in a row with %d different requests (the last: %s: %s); the "
                     "ranks are treated as broken", self._failed_in_a_row, len(self._failed_in_a_row_samples),
                     type(exc).__name__, exc)
        self._suspects.clear()  # all are recomputed on the rebuilt ranks
        return True

    def _probe_candidate(self) -> str | None:
        """A request to run alone as a probe of the ranks: not one of the requests that just failed,
        one that has produced tokens if any (it ran on these ranks), else any other unfinished one."""
        failed = self._failed_in_a_row_samples
        others = [r for r in (*self.scheduler.running, *self.scheduler.waiting)
                  if r.request_id not in failed and not r.is_finished]
        for request in others:
            if request.num_output_tokens > 0:
                return request.request_id
        return others[0].request_id if others else None

    def _plan_failed(self, only: str | None, exc: Exception) -> list[RequestOutput]:
        """Planning raised; the scheduler undid the plan. A plan of one request fails that request;
        a larger one is planned again whole once (a transient fault costs one step); failing again, it puts the requests it reached under suspicion, to be planned one per step (all
        the unfinished requests if it reached none), so that a fault that is not theirs costs nothing
        and one that is fails its request alone: never every request, never a loop."""
        self.num_failed_steps += 1
        if only is not None:
            self._suspects.popleft()
            request_id = self.outputs.request_id_of(only)
            logger.warning("planning a step for request %r alone failed (%s: %s)", request_id,
                           type(exc).__name__, exc, exc_info=exc)
            if request_id is None:
                self.scheduler.finish_requests([only], RequestStatus.FINISHED_ERROR)
                return []
            output = self._fail_request(request_id, type(exc).__name__)
            return [output] if output is not None else []
        sched = self.scheduler
        if not self._plan_retried:  # a transient fault costs one step: the whole plan is tried again
            self._plan_retried = True
            sched.failed_plan_requests = []
            logger.warning("planning a step failed (%s: %s); planning it again", type(exc).__name__, exc,
                           exc_info=exc)
            return []
        self._plan_retried = False
        reached = sched.failed_plan_requests or [r.request_id for r in (*sched.running, *sched.waiting)]
        sched.failed_plan_requests = []
        logger.warning("planning a step failed (%s: %s); planning its %d requests one at a time",
                       type(exc).__name__, exc, len(reached), exc_info=exc)
        known = set(self._suspects)
        self._suspects.extendleft(reversed([s for s in reached if s not in known]))
        return []

    def _step_ran(self, scheduler_output, runner_output, ran_alone: bool = False) -> list[RequestOutput]:
        """A step came back whole: the failure streak ends, and its outputs are taken (a failure while
        taking them fails its requests, ``_outputs_failed``). ``ran_alone``: it was the next suspect's,
        which is cleared."""
        self._failed_in_a_row = 0
        self._failed_in_a_row_samples.clear()
        self._probe_id = None
        request_outputs: list[RequestOutput] = []
        with self.lock:
            if ran_alone:
                self._suspects.popleft()  # it ran alone without failing
            try:
                self._take_outputs(scheduler_output, runner_output, request_outputs)
            except BaseException as exc:
                self._outputs_failed(scheduler_output, exc, request_outputs)
                if not isinstance(exc, Exception):
                    raise
        return request_outputs

    def _outputs_failed(self, scheduler_output, exc: BaseException, request_outputs: list[RequestOutput]) -> None:
        """Taking a step's outputs raised (past the per-request guards). The step ran, so its KV is
        good; but which of its requests got their tokens is unknown: each one still unfinished ends
        with an error (its blocks freed, its stream ended), the outputs already made are kept."""
        logger.error("taking the outputs of a step failed (%s: %s); failing its unfinished requests",
                     type(exc).__name__, exc, exc_info=exc)
        self.num_failed_steps += 1
        done = {o.request_id for o in request_outputs if o.finished}
        for sample_id in scheduler_output.num_scheduled_tokens:
            if sample_id not in self.scheduler.requests:
                continue
            request_id = self.outputs.request_id_of(sample_id)
            if request_id is None or request_id in done:
                self.scheduler.finish_requests([sample_id], RequestStatus.FINISHED_ERROR)
                continue
            output = self._fail_request(request_id, type(exc).__name__)
            if output is not None:
                request_outputs.append(output)
                done.add(request_id)

    def _isolate(self, scheduler_output, exc: Exception) -> list[RequestOutput]:
        """A step raised: a step of one request fails that request; a larger one puts its requests
        under suspicion, to run one per step next (each at most once per failure)."""
        self.num_failed_steps += 1
        sample_ids = list(scheduler_output.num_scheduled_tokens)
        if len(sample_ids) > 1:
            logger.warning("an engine step of %d requests failed (%s: %s); running them one at a time",
                           len(sample_ids), type(exc).__name__, exc)
            known = set(self._suspects)
            self._suspects.extendleft(reversed([s for s in sample_ids if s not in known]))
            return []
        if self._suspects and self._suspects[0] == sample_ids[0]:
            self._suspects.popleft()
        request_id = self.outputs.request_id_of(sample_ids[0])
        logger.warning("request %r failed the engine step that held it alone (%s: %s)",
                       request_id, type(exc).__name__, exc)
        if request_id is None:
            self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ERROR)
            return []
        kind = exc.kind if isinstance(exc, StepFailedError) else type(exc).__name__
        output = self._fail_request(request_id, kind)
        return [output] if output is not None else []

    def _fail_request(self, request_id: str, kind: str) -> RequestOutput | None:
        """End a request the engine could not run: its blocks freed, its final output carrying the
        error (one sentence naming the exception's type, nothing of its text)."""
        self.num_failed_requests += 1
        self.scheduler.finish_requests(self.outputs.sample_ids_of(request_id), RequestStatus.FINISHED_ERROR)
        return self.outputs.fail(request_id, f"the engine failed while running this request ({kind})")

    def _recover(self, failure: WorkerFailedError, budgeted: bool = True) -> None:
        """Rebuild the ranks and recompute every running request; the step that failed is lost
        whole (its tokens were never appended). At most ``max_worker_restarts`` rebuilds within
        ``worker_restart_window_s`` (a failure that comes back after every rebuild must not loop
        forever), each after the first waiting a doubling backoff; beyond that, or if the ranks
        cannot be rebuilt, the engine is dead: this and every later step raise EngineDeadError.
        ``budgeted=False``: a rebuild that is not the ranks' fault (a step raised with others in flight,
        ``engine.pipelined_steps``): not held against that budget, and made at once."""
        cfg = self.config
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > cfg.worker_restart_window_s:
            self._restart_times.popleft()
        recent = len(self._restart_times) if budgeted else 0
        if recent >= cfg.max_worker_restarts:
            self._dead = EngineDeadError(
                f"the workers failed again after {recent} restarts within "
                f"{cfg.worker_restart_window_s:g} s; the engine gives up on them")
            logger.error("engine step failed (%s): %s", failure, self._dead)
            raise self._dead
        logger.warning("engine step failed (%s); restarting the workers", failure)
        self._failed_in_a_row = 0
        self._probe_id = None
        self._failed_in_a_row_samples.clear()
        if recent:
            time.sleep(cfg.worker_restart_backoff_s * 2 ** (recent - 1))
        if budgeted:
            self._restart_times.append(time.monotonic())
        self._restart_ranks()

    def _restart_ranks(self, stuck: Exception | None = None) -> None:
        """Replace the ranks and recompute every running request. ``stuck``: a step that raised in a
        pipeline stage before it sent its activations (``StepFailedError.ranks_stuck``), already rolled
        back and counted by the search for the request at fault, which this leaves as it is; the
        rebuild is not held against the restart budget."""
        if stuck is not None:
            logger.warning("a pipeline stage raised before sending its activations (%s); restarting the "
                           "workers", stuck)
        self.num_worker_restarts += 1
        try:
            self.executor.restart()
        except Exception as exc:
            self._dead = EngineDeadError(f"the workers failed and could not be restarted: {exc}")
            raise self._dead from exc
        with self.lock:
            self.scheduler.recompute_all()

