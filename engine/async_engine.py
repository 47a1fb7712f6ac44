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
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.core import EngineCore, EngineDeadError, EngineOverloadedError, PromptType
from engine.messages import RequestOutput, merge_outputs
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """``max_waiting_requests``: requests admitted but not yet running beyond which ``generate``
    refuses new ones with EngineOverloadedError (None: unbounded)."""

    def __init__(self, config: EngineConfig, core: EngineCore | None = None,
                 max_waiting_requests: int | None = None) -> None:
        self.core = core or EngineCore(config)
        self.max_waiting_requests = max_waiting_requests
        self._queues: dict[str, asyncio.Queue] = {}
        self._commands: list[tuple] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")

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
        params = dataclasses.replace(sampling_params or SamplingParams(), output_kind=output_kind)
        text, token_ids = self.core.process_inputs(prompt)
        self.core.check_sampling_params(params)
        if not request_id or request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is empty or already in use")
        if self.max_waiting_requests is not None and self.num_waiting_requests >= self.max_waiting_requests:
            raise EngineOverloadedError(f"{self.num_waiting_requests} requests are already waiting "
                                        f"(max_waiting_requests={self.max_waiting_requests}); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(("add", request_id, text, token_ids, params, cache_salt))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                while not isinstance(item, BaseException) and not queue.empty():
                    nxt = queue.get_nowait()  # the reader fell behind: hand over one merged delta
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt, output_kind)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    @property
    def num_waiting_requests(self) -> int:
        """Admitted requests that are not running yet (queued here or in the scheduler)."""
        adds = sum(1 for c in self._commands if c[0] == "add")
        return adds + len(self.core.scheduler.waiting)

    def cached_prefix_hashes(self, limit: int = 16384) -> bytes:
        """The prefix cache's block hashes, truncated to 8 bytes each and concatenated (a routing
        summary: a router matches a prompt's chain of hashes against it)."""
        return self.core.scheduler.kv.cached_hash_digest(limit)

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self._wakeup.set()

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                _, request_id, text, token_ids, params, cache_salt = command
                if request_id not in self._queues:
                    continue  # its caller left before the request started
                try:
                    self.core.add_processed_request(request_id, text, token_ids, params, cache_salt=cache_salt)
                except ValueError as exc:
                    self._queues[request_id].put_nowait(exc)
            else:
                output = self.core.abort_request(command[1])
                queue = self._queues.get(command[1])
                if output is not None and queue is not None:
                    queue.put_nowait(output)  # ends the stream with finish_reason "abort"

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_commands()
            if not self.core.has_unfinished_requests():
                self._wakeup.clear()
                if not self._commands:
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._step_thread, self.core.step)
            except Exception as exc:
                logger.exception("engine step failed")
                self._fail_all(exc if isinstance(exc, EngineDeadError) else
                               EngineDeadError(f"engine step failed: {exc!r}"))
                continue
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            await asyncio.sleep(0)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, queue in list(self._queues.items()):
            self.core.abort_request(request_id)
            queue.put_nowait(error)

    def stats(self) -> dict:
        return self.core.stats()

    def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._step_thread.shutdown(wait=True)
        self.core.shutdown()
