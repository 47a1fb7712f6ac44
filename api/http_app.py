"""The OpenAI-compatible HTTP API: a FastAPI app whose routes are plain functions that fetch the
``OpenAIServing`` through ``get_serving()`` at request time, so that a Ray Serve ingress can mount it
and create the serving object in its ``__init__``::

    app = build_openai_app(lambda: serve.get_replica_context().servable_object.serving)

    @serve.deployment
    @serve.ingress(app)
    class Ingress:
        def __init__(self, ...):
            self.serving = OpenAIServing(engine_client, tokenizer, name, max_model_len)

Routes (the Bearer key, when ``api_key`` is set, guards all but /health, /metrics, /version and
the /dashboard page, which asks for the key itself):

    POST /v1/completions   POST /v1/chat/completions   GET /v1/models   GET /v1/models/{id}
    POST /tokenize         POST /detokenize            GET /health   GET /metrics   GET /version
    GET /dashboard         GET /dashboard/data         (the live KV-cache map: api/dashboard.py)

Every error has the OpenAI body ``{"error": {message, type, param, code}}``: malformed JSON and invalid
fields → 400 (naming the field), a bad key → 401, ``OpenAIError`` → its status, anything else → 500.
A client that disconnects before its response starts has its engine requests aborted; a stream that
loses its client is aborted by ``EventStream``.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
from collections.abc import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.dashboard import dashboard_data, dashboard_page
from api.errors import OpenAIError
from api.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from api.openai_chat_protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from api.openai_protocol import CompletionRequest
from api.openai_serving import EventStream, OpenAIServing

try:
    VERSION = importlib.metadata.version("kvserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "unknown"
PROMETHEUS_CONTENT_TYPE = METRICS_CONTENT_TYPE  # prometheus_client's classic text format (0.0.4)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def build_openai_app(get_serving: Callable[[], OpenAIServing], *, api_key: str | None = None,
                     metrics_text: Callable[[], Awaitable[str]] | None = None,
                     kv_map: Callable[[], Awaitable[dict]] | None = None,
                     max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """The app. ``metrics_text`` supplies the Prometheus exposition served at /metrics (absent: 404);
    ``kv_map`` each engine replica's KV-map snapshot by replica (``engine.kv_map.KVMonitor.snapshot``),
    served at /dashboard/data and drawn by /dashboard (absent: both 404). A request body over
    ``max_body_bytes`` is refused with 413 before it is parsed (``BodySizeLimit``).

    The routes are module-level functions that read these settings from ``app.state``: an app that
    Ray Serve pickles keeps them importable by name, with their annotations resolvable (a nested
    function would be pickled by value, without the globals its string annotations name).
    """
    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM inference")
    app.state.get_serving, app.state.api_key, app.state.metrics_text = get_serving, api_key, metrics_text
    app.state.kv_map = kv_map
    guarded = [Depends(require_api_key)]
    app.add_api_route("/v1/completions", create_completion, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"], dependencies=guarded)
    app.add_api_route("/tokenize", tokenize, methods=["POST"], dependencies=guarded)
    app.add_api_route("/detokenize", detokenize, methods=["POST"], dependencies=guarded)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    if metrics_text is not None:
        app.add_api_route("/metrics", metrics, methods=["GET"])
    if kv_map is not None:
        app.add_api_route("/dashboard", dashboard_page, methods=["GET"], include_in_schema=False)
        app.add_api_route("/dashboard/data", dashboard_data, methods=["GET"], dependencies=guarded)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


class BodySizeLimit:
    """ASGI middleware: a request whose body is over ``max_bytes`` gets a 413 with the OpenAI body
    before any of it is parsed: at once when its Content-Length says so, else as soon as the bytes
    received pass the cap (a chunked upload). The body is read here, then handed on whole."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, send, int(length))
        chunks, size, more, pending = [], 0, True, None
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees the disconnect
                chunks, more = None, False
                pending = message
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, send, None)
            more = message.get("more_body", False)
        first = pending if chunks is None else {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return first
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send, length: int | None) -> None:
        size = f"{length} bytes" if length is not None else "more than that"
        error = OpenAIError(413, f"the request body may hold at most {self.max_bytes} bytes (the server's "
                                 f"max_request_body_bytes), got {size}", "invalid_request_error",
                            code="request_too_large")
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, _no_receive, send)


async def _no_receive() -> dict:
    return {"type": "http.disconnect"}


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.get_serving()


# --- routes --------------------------------------------------------------------------------------


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _respond(request, _serving(request).completions(body))


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _respond(request, _serving(request).chat_completions(body))


async def list_models(request: Request) -> Response:
    return JSONResponse(await _serving(request).models())


async def retrieve_model(model_id: str, request: Request) -> Response:
    return JSONResponse(await _serving(request).model(model_id))


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return JSONResponse(await _serving(request).tokenize(body))


async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return JSONResponse(await _serving(request).detokenize(body))


async def health(request: Request) -> Response:
    _serving(request)
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    return PlainTextResponse(await request.app.state.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)


async def require_api_key(request: Request) -> None:
    """With an API key configured, the request must carry ``Authorization: Bearer <key>``."""
    api_key = request.app.state.api_key
    if api_key is None:
        return
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
        raise OpenAIError(401, "invalid or missing API key: send `Authorization: Bearer <key>`",
                          "invalid_request_error", code="invalid_api_key")


async def _respond(request: Request, work: Awaitable[dict | EventStream]) -> Response:
    """Run ``work`` unless the client disconnects first (then it is cancelled, which aborts its engine
    requests); its dict becomes JSON, its EventStream an SSE response that is closed even if unsent."""
    work_task = asyncio.ensure_future(work)
    client_gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work_task, client_gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone.cancel()
        if not work_task.done():
            work_task.cancel()  # the client left first (or we were cancelled): abort the engine requests
    if not work_task.done():  # cancelled just now
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    result = work_task.result()
    if isinstance(result, EventStream):
        return StreamingResponse(result, media_type="text/event-stream", background=BackgroundTask(result.aclose))
    return JSONResponse(result)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- errors --------------------------------------------------------------------------------------


async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return _error_response(exc)


async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(_validation_error(exc))


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error_response(OpenAIError(exc.status_code, str(exc.detail), kind), getattr(exc, "headers", None))


async def internal_error(_: Request, exc: Exception) -> JSONResponse:
    return _error_response(OpenAIError.from_exception(exc))


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _field_path(loc: tuple) -> str:
    """``("body", "messages", 0, "content", "list[ContentPart]", 0, "text")`` → ``messages.0.content.0.text``:
    the body (or query) prefix and pydantic's union-member tags dropped (fields are lower-case identifiers)."""
    parts = loc[1:] if loc[:1] in (("body",), ("query",)) else loc
    path = ".".join(str(p) for p in parts if not (isinstance(p, str) and (
        "[" in p or p in _UNION_TAGS or p[:1].isupper())))
    return path.encode("utf-8", "backslashreplace").decode("utf-8")  # a client's dict key may be any text


def validation_error(exc) -> OpenAIError:
    """A request body's validation errors (FastAPI's RequestValidationError or pydantic's
    ValidationError) as the 400 the API sends."""
    return _validation_error(exc)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """One sentence for the client: the first error that says more than "wrong type" (a union's
    members each report one), naming its field, and how many other fields are invalid."""
    errors = exc.errors()
    malformed = next((e for e in errors if e["type"] == "json_invalid"), None)
    if malformed is not None:
        return OpenAIError.bad_request(f"malformed JSON in the request body: {malformed.get('ctx', {}).get('error')}")
    if not errors:
        return OpenAIError.bad_request("the request body is invalid")
    error = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    field = _field_path(error["loc"])
    if not field and isinstance(error.get("input"), bytes):
        return OpenAIError.bad_request("the request body must be a JSON object (Content-Type: application/json)")
    message = f"{field}: {error['msg']}" if field else error["msg"]
    top = field.split(".")[0] or None
    others = {_field_path(e["loc"]).split(".")[0] for e in errors} - {top, ""}
    if others:
        message += f" (and {len(others)} other invalid field{'s' if len(others) > 1 else ''})"
    return OpenAIError.bad_request(message, top)
