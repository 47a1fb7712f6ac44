"""AsyncLLM: the streaming interface (add a request, stream its deltas, abort it).

One background task owns the EngineCore. Adds and aborts from any coroutine are queued and applied
between steps; each step runs in a dedicated thread so the event loop keeps serving while the model
computes::

    generate() --queue--> [step loop: apply adds/aborts -> core.step() in thread -> route outputs]
        ^                                                                   |
        +----------------------- per-request asyncio.Queue <----------------+
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.core import EngineCore, EngineDeadError, EngineOverloadedError, PromptType, RequestFailedError
from engine.messages import RequestOutput, merge_outputs
from engine.prefix_report import PrefixReport
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.structured_output import (CompileQueueFullError, compile_queue_message, compile_started_at,
                                      compile_timeout_message)

logger = logging.getLogger(__name__)

Sink = Callable[["RequestOutput | BaseException"], None]

# what clients read when the engine fails in a way no single request explains (details in the log)
STEP_FAILED = "the engine failed while running its requests"
ADD_FAILED = "the engine failed while admitting this request"


class AsyncLLM:
    """``max_waiting_requests``: requests admitted but not yet running beyond which ``generate``
    refuses new ones with EngineOverloadedError (None: unbounded). Requests waiting for their grammar
    to compile are counted apart, against the same number: at most ``max_waiting_requests`` of them."""

    def __init__(self, config: EngineConfig, core: EngineCore | None = None,
                 max_waiting_requests: int | None = None) -> None:
        self.core = core or EngineCore(config)
        self.max_waiting_requests = max_waiting_requests
        self._sinks: dict[str, Sink] = {}
        self._commands: list[tuple] = []
        # admitted requests whose grammar is still compiling (not yet queued):
        # id -> (future, timer, the request's add command, when it was submitted (time.monotonic()))
        self._compiling: dict[str, tuple] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        # the router's report: only what changed since the last one is read under the lock
        self._prefix_report = PrefixReport(lambda cursor: self.core.scheduler.kv.block_pool.recent.read(cursor),
                                           self.core.lock)

    def submit(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        sink: Sink,
        *,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> None:
        """Admit a request whose outputs (and the error that ends it, if any) go to ``sink``, called
        on the event loop. Raises ValueError for invalid input and EngineOverloadedError when the
        waiting queue is full, before anything runs."""
        if self.core.dead is not None:
            raise EngineDeadError(str(self.core.dead))
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(sampling_params).__name__}")
        params = dataclasses.replace(sampling_params or SamplingParams(), output_kind=output_kind)
        text, token_ids = self.core.process_inputs(prompt)
        self.core.check_sampling_params(params, len(token_ids))
        if not request_id or request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is empty or already in use")
        if self.max_waiting_requests is not None and self.num_waiting_requests >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.num_waiting_requests} requests are already waiting "
                                        f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        command = ("add", request_id, text, token_ids, params, cache_salt, None)
        if params.structured_outputs is not None:
            # compiled on the engine's grammar threads; the request is queued once its grammar is ready
            # (a new schema never stalls the step loop), at once on a cache hit. Pending compiles have
            # their own bound (structured_output_max_pending_compiles), not max_waiting_requests
            manager = self.core.structured_outputs
            if self.max_waiting_requests is not None and len(self._compiling) >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"{len(self._compiling)} requests are already waiting for their structured output grammar "
                    f"(max_waiting_requests={self.max_waiting_requests}); retry later")
            try:
                future = manager.compile_async(params.structured_outputs)  # ValueError past a bound
            except CompileQueueFullError as exc:
                raise EngineOverloadedError(str(exc)) from None
            if future.done():
                manager.release(future)
                command = command[:-1] + (future.result(),)  # a constraint that does not compile raises here
            else:
                self._sinks[request_id] = sink
                loop = asyncio.get_running_loop()
                timer = loop.call_later(manager.compile_timeout_s, self._check_compile, request_id)
                self._compiling[request_id] = (future, timer, command, time.monotonic())
                # the callback holds the request's id only: a cached grammar's future keeps its callbacks
                future.add_done_callback(functools.partial(self._wake, loop, request_id))
                return
        self._sinks[request_id] = sink
        self._submit(command)

    def _wake(self, loop, request_id: str, future) -> None:
        """On the compiling thread: hand the finished compile to the event loop (gone: nobody waits)."""
        try:
            loop.call_soon_threadsafe(self._compiled, request_id, future)
        except RuntimeError:
            pass  # the loop closed

    def _compiled(self, request_id: str, future) -> None:
        """A grammar finished compiling (on the event loop): queue its request, or refuse it."""
        entry = self._compiling.get(request_id)
        if entry is None or entry[0] is not future:
            return  # aborted or timed out meanwhile
        command = entry[2]
        self._end_compile(request_id)
        if future.cancelled():  # the engine shut down
            self._deliver(request_id, EngineDeadError("the engine shut down"))
            return
        exc = future.exception()
        if exc is not None:
            self._deliver(request_id, exc if isinstance(exc, ValueError) else
                          ValueError(f"the structured output constraint could not be compiled: {exc}"))
            return
        self._submit(command[:-1] + (future.result(),))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str = "",
        *,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Invalid input raises ValueError before anything runs;
        leaving the iteration early (a client that went away) aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt, sampling_params, queue.put_nowait, cache_salt=cache_salt,
                    output_kind=output_kind)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                while not isinstance(item, BaseException) and not queue.empty():
                    nxt = queue.get_nowait()  # the reader fell behind: hand over one merged delta
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt, output_kind)
                if isinstance(item, BaseException):
                    finished = True  # the engine ended it (refused or failed it): nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its sink gets a final output with finish_reason "abort" (if it was running).
        A request still compiling its grammar ends at once, with no tokens (its compile is cancelled if
        nobody else waits for it and it has not started)."""
        if request_id in self._compiling:
            self._end_compile(request_id)
            self._deliver(request_id, RequestOutput(request_id, None, [], [], True))
            return
        self._submit(("abort", request_id))

    def _end_compile(self, request_id: str) -> None:
        """A compiling request stops waiting for its grammar (compiled, timed out or aborted)."""
        future, timer, _, _ = self._compiling.pop(request_id)
        timer.cancel()
        self.core.structured_outputs.release(future)

    def _check_compile(self, request_id: str) -> None:
        """The timer of a compiling request: its compile may take ``compile_timeout_s`` from when it
        started (past it: the constraint's fault, 400); one that has not started within that long
        since the request came is refused as overload (503), the grammar threads being busy, unless
        the backend is still being built (its one-time set-up: the request waits on)."""
        entry = self._compiling.get(request_id)
        if entry is None:
            return
        manager = self.core.structured_outputs
        timeout_s, started, now = manager.compile_timeout_s, compile_started_at(entry[0]), time.monotonic()
        if started is None and now - entry[3] >= timeout_s and manager.backend_ready:
            error = EngineOverloadedError(compile_queue_message(timeout_s, manager.compile_threads))
        elif started is not None and now - started >= timeout_s:
            error = ValueError(compile_timeout_message(timeout_s))
        else:  # not yet: look again when it would be due (soon, while the backend is being built)
            due = (entry[3] if started is None else started) + timeout_s
            if started is None and not manager.backend_ready:
                due = now + 0.05
            timer = asyncio.get_running_loop().call_later(max(0.0, due - now), self._check_compile, request_id)
            self._compiling[request_id] = (entry[0], timer, entry[2], entry[3])
            return
        self._end_compile(request_id)
        self._deliver(request_id, error)

    @property
    def num_waiting_requests(self) -> int:
        """Admitted requests that will have to wait: those not running yet (queued here or in the
        scheduler) beyond the free places of the running batch."""
        scheduler = self.core.scheduler  # requests still compiling their grammar are counted apart
        adds = sum(1 for c in self._commands if c[0] == "add")
        free = max(0, scheduler.max_num_seqs - len(scheduler.running))
        return max(0, adds + len(scheduler.waiting) - free)

    def cached_prefix_hashes(self, limit: int = 16384) -> bytes:
        """The prefix cache's block hashes, most recently used first, truncated to 8 bytes each and
        concatenated (a routing summary: a router matches a prompt's chain of hashes against it).
        Safe to call from any thread: a consistent snapshot, taken between the step's changes."""
        return self.core.cached_prefix_hashes(limit)

    def routing_report(self) -> dict:
        """The prefix cache's routing report as a router merges it (``engine/prefix_report.py``):
        ``prefix_hashes`` (a base), ``prefix_added`` and ``prefix_removed`` (the changes since). Under
        the engine's lock it copies only the changes since the last report (the whole set of 16384
        hashes on the first one)."""
        return self._prefix_report.report()

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self._wakeup.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        sink = self._sinks.get(request_id)
        if sink is None:
            return
        if isinstance(item, RequestOutput) and item.error is not None:
            item = RequestFailedError(item.error)  # this request alone failed: its stream ends with it
        if isinstance(item, BaseException) or item.finished:
            del self._sinks[request_id]
        sink(item)

    def is_open(self, request_id: str) -> bool:
        """Whether ``request_id`` still has an item to come (a delta, its final output or its error)."""
        return request_id in self._sinks

    def _apply_commands(self) -> None:
        """Apply the queued adds and aborts. Each command is guarded alone: an add that raises fails
        that request (its sink gets the error: a ValueError as it is, anything else as one clean
        sentence, the details in the log); an abort that raises is logged and its request still
        ends. Nothing here can stop the step loop or drop the rest of the batch."""
        commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                self._apply_add(command)
            else:
                self._apply_abort(command[1])

    def _apply_add(self, command: tuple) -> None:
        _, request_id, text, token_ids, params, cache_salt, grammar = command
        if request_id not in self._sinks:
            return  # aborted before it started
        try:
            self.core.add_processed_request(request_id, text, token_ids, params, cache_salt=cache_salt,
                                            grammar=grammar)
        except ValueError as exc:
            self._deliver(request_id, exc)
        except Exception:  # this request fails, not the batch
            logger.exception("adding request %r to the engine failed", request_id)
            self._discard(request_id)
            self._deliver(request_id, RequestFailedError(ADD_FAILED))

    def _apply_abort(self, request_id: str) -> None:
        try:
            output = self.core.abort_request(request_id)
        except Exception:  # the request is still removed
            logger.exception("aborting request %r failed; removing it", request_id)
            self._discard(request_id)
            output = None
        if request_id not in self._sinks:
            return
        if output is None:  # not (or no longer) in the engine: still end its stream, so nothing waits on it
            output = RequestOutput(request_id, None, [], [], True)
        self._deliver(request_id, output)  # ends the stream with finish_reason "abort"

    def _discard(self, request_id: str) -> None:
        try:
            self.core.discard_request(request_id)
        except Exception:
            logger.exception("removing request %r from the engine failed", request_id)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._apply_commands()
            except Exception:  # cannot happen (every command is guarded); never die
                logger.exception("applying the queued requests failed")
            if not self.core.has_unfinished_requests():
                self._wakeup.clear()
                if not self._commands:
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._step_thread, self.core.step)
            except Exception as exc:
                logger.exception("engine step failed")
                self._fail_all(exc if isinstance(exc, EngineDeadError) else EngineDeadError(STEP_FAILED))
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            await asyncio.sleep(0)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._sinks):
            try:
                self.core.abort_request(request_id)
            except Exception:  # every sink still gets the error
                logger.exception("aborting request %r failed; removing it", request_id)
                self._discard(request_id)
            self._deliver(request_id, error)

    def stats(self) -> dict:
        return self.core.stats()

    def on_step_thread(self, fn, *args):
        """``fn(*args)`` on the thread that runs the engine's steps, waited for (e.g. binding its
        OpenMP threads: OpenMP keeps one team of threads per calling thread)."""
        return self._step_thread.submit(fn, *args).result()

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._step_thread.shutdown(wait=True)
        self.core.shutdown()
