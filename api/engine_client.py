"""What the OpenAI layer needs of an engine, the in-process adapter, the error type the HTTP layer
renders, and ``EngineStreams``: the engine requests of one API request, run side by side.

    EngineStreams ── task per prompt ─► engine.generate(id-0) ─┐
                  ── task per prompt ─► engine.generate(id-1) ─┴─► queue ─► (prompt index, delta)

Closing it (client gone, error, done) cancels the tasks; each aborts its engine request unless the
engine already ended it.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Protocol

from api.openai_protocol import ErrorInfo, ErrorResponse
from engine.async_engine import AsyncLLM
from engine.core import EngineDeadError, EngineOverloadedError, RequestFailedError
from engine.messages import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineClient(Protocol):
    """``generate`` streams DELTA outputs of one request (n samples inside it) and raises ValueError
    for bad input, EngineOverloadedError when the queue is full; ``abort`` ends a request (an unknown
    or finished id is a no-op)."""

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


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_MAX_MESSAGE_CHARS = 1000


def root_cause(exc: BaseException) -> BaseException:
    """The exception a remote call re-raised: Ray's ``RayTaskError(X)`` (an instance of ``X`` whose text
    is the remote traceback, with task name, pid and address) carries the original as ``cause``."""
    for _ in range(8):  # nested wrappers, boundedly
        inner = getattr(exc, "cause", None)
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    return exc


def clean_message(exc: BaseException | str) -> str:
    """One line a client may read: the root cause's message without colour codes, without a traceback
    (its last line, the exception's own, without the ``Type:`` prefix), without characters UTF-8
    cannot carry, and bounded in length."""
    text = _ANSI_ESCAPE.sub("", exc if isinstance(exc, str) else str(root_cause(exc)))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith(("Traceback (most recent call last)", "File \"")) for line in lines):
        lines = [re.sub(r"^[A-Za-z_][\w.]*(\([\w.]+\))?: ", "", lines[-1])]
    text = " ".join(lines)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS - 3] + "..."


def _rebuild_error(cls: type, args: tuple, state: dict) -> Exception:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class OpenAIError(Exception):
    """An error as the API reports it: HTTP status and the body ``{"error": {message, type, param, code}}``.
    The body's message is ``clean_message``'s: one line, no colour codes or tracebacks, valid UTF-8."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = status if code is None else code

    def __reduce__(self):
        # rebuilt from its state, not through __init__ (subclasses take other arguments), so that it
        # crosses processes whole: a Serve handle's caller gets the status and body the API would send
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))

    def body(self) -> dict:
        param = None if self.param is None else clean_message(self.param)
        info = ErrorInfo(message=clean_message(self.message), type=self.type, param=param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> OpenAIError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def from_exception(cls, exc: BaseException) -> OpenAIError:
        """ValueError → 400, EngineOverloadedError → 503, anything else (engine failures, a request
        the engine failed alone: ``request_failed``) → 500. An exception re-raised by a remote call
        is judged, and reported, by its root cause (``root_cause``), in ``clean_message``'s one line."""
        if isinstance(exc, OpenAIError):
            return exc
        cause = root_cause(exc)
        if isinstance(exc, ValueError) or isinstance(cause, ValueError):
            return cls.bad_request(clean_message(cause))
        if isinstance(exc, EngineOverloadedError) or isinstance(cause, EngineOverloadedError):
            return cls(503, clean_message(cause), "server_error", code="engine_overloaded")
        if isinstance(exc, EngineDeadError) or isinstance(cause, EngineDeadError):
            return cls(500, clean_message(cause), "server_error", code="engine_dead")
        if isinstance(exc, RequestFailedError) or isinstance(cause, RequestFailedError):
            return cls(500, clean_message(cause), "server_error", code="request_failed")
        logger.error("request failed", exc_info=exc)
        return cls(500, f"internal error: {type(cause).__name__}", "server_error", code="internal_error")


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
