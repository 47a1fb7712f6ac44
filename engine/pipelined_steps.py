"""Steps in flight: where the executor's ranks are pipeline stages (``Executor.max_steps_in_flight`` >
1), the engine plans step k+1 and sends it while step k is still in the later stages, so that every
stage has a step of its own to run instead of waiting for the others (the bubble of one batch).

Why it is safe without more bookkeeping:

- every rank runs its steps in the order they were sent, so a block freed after step k (a request
  finished, aborted or preempted by step k+1's plan) and handed to another request in step k+1 is
  written by step k before step k+1 reads or overwrites it, on every stage;
- a request whose step is in flight is not planned again until its tokens are back: the scheduler
  advanced its computed tokens when it planned it, so it has nothing left to compute (a prompt's
  next chunk may be planned: it runs after the previous one, on every stage);
- a request preempted and planned again while an older step of it was in flight takes no token from
  that step (``SchedulerOutput.step_id``).

What it gives up: a step that raises inside a rank while others are in flight cannot be rolled back
one plan at a time (each undo restores the state its plan started from), and a stage that raised
before sending its activations leaves the next stage waiting for them (it would take the next step's
instead): the ranks are rebuilt at once (the steps out dropped, not waited for) and every running
request recomputed, as for a lost rank but not held against ``max_worker_restarts``; steps then run one
at a time for ``SERIAL_STEPS_AFTER_FAILURE`` steps, where the one-step machinery
(``engine.step_failures``) finds a request at fault and fails it alone. An interruption
(KeyboardInterrupt) leaves the steps out as they are: the next call collects them in order (through
a compiled graph, whose answers can be read once, the interrupted step's answer is lost and the next
call rebuilds the ranks as for a step that raised).
"""

from __future__ import annotations

import time
from collections import deque

from engine.executor import WorkerFailedError
from engine.messages import RequestOutput


class PipelinedSteps:
    """A mixin of ``EngineCore`` (which holds the scheduler, executor, lock, timings and the failure
    state of ``engine.step_failures.StepFailures``)."""

    SERIAL_STEPS_AFTER_FAILURE = 16

    def _init_in_flight(self) -> None:
        self._in_flight: deque = deque()  # (scheduler output, executor handle, when it was sent)
        self._serial_until = 0  # steps run one at a time until timings.num_steps reaches this
        self._slot = 0  # the requests' slot the next step plans first (Scheduler.schedule(slot=...))
        self.scheduler.num_slots = self.executor.max_steps_in_flight

    def _pipelining(self) -> bool:
        return (self.executor.max_steps_in_flight > 1 and not self._suspects and self._probe_id is None
                and self.timings.num_steps >= self._serial_until)

    def _step_in_flight(self) -> list[RequestOutput]:
        """Plan and send a step if fewer than ``max_steps_in_flight`` are out; answer the oldest step's
        outputs once they are full (or nothing more could be planned), else nothing yet."""
        sent = False
        depth = self.executor.max_steps_in_flight
        if len(self._in_flight) < depth:
            for _ in range(depth):  # the next slot with something to run
                with self.lock:
                    try:
                        scheduler_output = self.scheduler.schedule(slot=self._slot, num_slots=depth)
                    except Exception as exc:  # noqa: BLE001 - the plan was undone; the steps in flight are untouched
                        return self._plan_failed(None, exc)
                    self._plan_retried = False
                self._slot = (self._slot + 1) % depth
                if not scheduler_output.is_empty:
                    try:
                        handle = self.executor.submit(scheduler_output)
                    except BaseException as exc:  # sent to some ranks, maybe: they are out of step
                        self._rebuild(exc)
                        return []
                    self._in_flight.append((scheduler_output, handle, time.perf_counter()))
                    sent = True
                    break
        if not self._in_flight or (sent and len(self._in_flight) < self.executor.max_steps_in_flight):
            return []
        return self._collect_oldest()

    def _collect_oldest(self) -> list[RequestOutput]:
        scheduler_output, handle, sent_at = self._in_flight[0]
        try:
            runner_output = self.executor.collect(handle)
        except Exception as exc:  # noqa: BLE001 - a lost rank, or a step that raised inside one
            self._rebuild(exc)
            return []
        self._in_flight.popleft()  # (an interruption above leaves it out, to be collected next time)
        request_outputs = self._step_ran(scheduler_output, runner_output)
        self.timings.record(time.perf_counter() - sent_at, runner_output.forward_time_s,
                            runner_output.execute_time_s, 0.0)
        return request_outputs

    def _rebuild(self, exc: BaseException) -> None:
        """Drop the steps out and rebuild the ranks (``_recover``: every running request recomputed); a
        lost rank is held against the restart budget, a step that raised is not, and is followed by
        steps one at a time. An interruption goes on once the engine is consistent."""
        # held until the ranks are rebuilt: a compiled graph's step dropped before its graph is torn
        # down waits for its answer, which a stuck stage never gives
        dropped = list(self._in_flight)
        self._in_flight.clear()
        if isinstance(exc, WorkerFailedError):
            self._recover(exc)
        else:
            self._serial_until = self.timings.num_steps + self.SERIAL_STEPS_AFTER_FAILURE
            self._recover(WorkerFailedError(f"a step raised {type(exc).__name__} with other steps in flight"),
                          budgeted=False)
        del dropped
        if not isinstance(exc, Exception):
            raise exc
