"""The error type the API renders (HTTP status and an OpenAI error body; gRPC maps the status) and
the one-line cleaning of what a client reads. Light on purpose: the LLMServer replica raises these
without loading the API's schemas (``body`` loads them when a response is built)."""

from __future__ import annotations

import logging
import re

from engine.core import EngineDeadError, EngineOverloadedError, RequestFailedError

logger = logging.getLogger(__name__)


# what a client reads for each kind of failure: fixed sentences, the exception's own text goes to the log
OVERLOADED_MESSAGE = "the server is at capacity; retry later"
ENGINE_DEAD_MESSAGE = "the engine failed and cannot serve this request; retry shortly"
REQUEST_FAILED_MESSAGE = "the engine failed while running this request"
INTERNAL_MESSAGE = "internal server error"

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
        from api.openai_protocol import ErrorInfo, ErrorResponse

        info = ErrorInfo(message=clean_message(self.message), type=self.type, param=param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> OpenAIError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def from_exception(cls, exc: BaseException) -> OpenAIError:
        """ValueError → 400 with its message (the engine's and the protocol's checks of a request: text
        this project writes for the client); every other exception by its type alone, to one fixed
        sentence, its own text (which may hold a host's repr, an actor id, a pid or an address) going
        to the log: EngineOverloadedError → 503 ``engine_overloaded``, EngineDeadError → 500
        ``engine_dead``, RequestFailedError (a request the engine failed alone) → 500
        ``request_failed``, anything else → 500 ``internal_error``. An exception re-raised by a remote
        call is judged by its root cause (``root_cause``)."""
        if isinstance(exc, OpenAIError):
            return exc
        cause = root_cause(exc)
        if isinstance(exc, ValueError) or isinstance(cause, ValueError):
            return cls.bad_request(clean_message(cause))
        if isinstance(exc, EngineOverloadedError) or isinstance(cause, EngineOverloadedError):
            logger.info("request refused: %s", clean_message(cause))
            return cls(503, OVERLOADED_MESSAGE, "server_error", code="engine_overloaded")
        for kind, message, code in ((EngineDeadError, ENGINE_DEAD_MESSAGE, "engine_dead"),
                                    (RequestFailedError, REQUEST_FAILED_MESSAGE, "request_failed")):
            if isinstance(exc, kind) or isinstance(cause, kind):
                logger.error("request failed (%s): %s", code, clean_message(cause))
                return cls(500, message, "server_error", code=code)
        logger.error("request failed", exc_info=exc)
        return cls(500, INTERNAL_MESSAGE, "server_error", code="internal_error")
