"""What the OpenAI layer needs of an engine, the in-process adapter, and ``EngineStreams``: the engine requests of one API request, run side by side.

    EngineStreams ── task per prompt ─► engine.generate(id-0) ─┐
                  ── task per prompt ─► engine.generate(id-1) ─┴─► queue ─► (prompt index, delta)

Closing it (client gone, error, done) cancels the tasks; each aborts its engine request unless the
engine already ended it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from engine.async_engine import AsyncLLM
from engine.messages import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """``generate`` streams DELTA outputs of one request (n samples inside it) and raises ValueError
    for bad input, EngineOverloadedError when the queue is full; ``abort`` ends a request (an unknown
    or finished id is a no-op). Callers pass ids they made themselves, never a client's; a client may
    key the engine by ids of its own (the Serve Ingress's does, and ends a request with its stream)."""

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...


class AsyncLLMClient:
    """An in-process ``engine.AsyncLLM`` as an ``EngineClient`` (tests, single-process servers)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        return self.llm.generate(prompt_token_ids, params, request_id, cache_salt=cache_salt,
                                 output_kind=RequestOutputKind.DELTA)

    async def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)


_END = object()  # a pump is done: its stream ended, or failed (the error came just before)


class EngineStreams:
    """The engine requests of one API request (one per prompt), started at once and merged into
    ``(prompt index, RequestOutput delta)`` in arrival order; an engine error is raised from the
    iteration. The queue holds about one delta per request: a reader that falls behind leaves the
    rest in the engine, which merges consecutive deltas. ``close()`` is synchronous and idempotent,
    so it is safe in the cleanup of a task that is being cancelled; the pump tasks then abort every
    request the engine had not ended."""

    def __init__(self, engine: EngineClient, request_ids: list[str], prompts: list[list[int]],
                 params: SamplingParams, cache_salt: str | None, tasks: set[asyncio.Task]) -> None:
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=len(request_ids))
        self._num_open = len(request_ids)
        self._first: tuple[int, RequestOutput] | None = None
        self._tasks = [asyncio.create_task(self._pump(i, rid, ids, params, cache_salt))
                       for i, (rid, ids) in enumerate(zip(request_ids, prompts))]
        for task in self._tasks:  # the loop keeps only weak references to tasks
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _pump(self, index: int, request_id: str, prompt: list[int], params: SamplingParams,
                    cache_salt: str | None) -> None:
        stream = self._engine.generate(request_id, prompt, params, cache_salt)
        ended = False  # the engine ended the request: finished, refused or failed it
        try:
            try:
                async for output in stream:
                    ended = output.finished
                    await self._queue.put((index, output))
                ended = True
            except Exception as exc:
                ended = True
                await self._queue.put(exc)
            await self._queue.put(_END)
        finally:
            if not ended:  # cancelled by close(): the client is gone or the request failed elsewhere
                await aclose_quietly(stream)
                try:
                    await self._engine.abort(request_id)
                except Exception:
                    logger.exception("aborting request %s failed", request_id)

    async def _next(self) -> tuple[int, RequestOutput] | None:
        while self._num_open:
            item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return item
        return None

    async def wait_started(self) -> None:
        """Wait for the first output (kept for the iteration), so that errors of admission (bad input,
        queue full) raise here, before a response has started."""
        self._first = await self._next()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while (item := await self._next()) is not None:
            yield item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def aclose_quietly(stream: AsyncIterator[RequestOutput]) -> None:
    """Close an engine stream if it can be closed; a failure to close is logged, not raised."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            logger.exception("closing an engine stream failed")
