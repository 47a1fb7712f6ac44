"""What the Ingress knows of the engines behind it: ``EngineWatch`` (is any engine replica of the
application serving?) and ``EngineGate`` (the HTTP app's middleware that answers 503 while none is,
before a request's body is read)."""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import math
import time

import ray
from fastapi.responses import JSONResponse

from api.errors import OVERLOADED_MESSAGE, OpenAIError
from cluster.llm_server import ENGINE_NAMESPACE, EngineUnavailableError

RETRY_AFTER_S = 2  # the Retry-After of every 503
NO_ENGINE = "no engine replica is serving yet (starting, restarting or waiting for resources); retry shortly"


class EngineWatch:
    """Whether an engine of this application serves: its scheduler actors (named
    ``engine:<app>:<replica>``) are asked ``ready``, at most once a second. While an application that
    keeps at least one replica (``min_engines`` > 0; autoscaling from zero has none to ask) has no
    engine answering, the Ingress refuses requests with 503 instead of leaving them waiting for a
    replica that is starting, being replaced, or cannot be placed. While none answers it asks
    every ``DOWN_PERIOD_S``, so that a replica that comes back is used within that time.

    ``actors()`` is the app's scheduler actors by name, for /metrics and /dashboard/data too: Ray's
    lookups (GCS calls that block) run on a thread, never on the Ingress's event loop, and their answer
    is kept for ``ACTORS_TTL_S`` (an unauthenticated /metrics scraped in a loop costs one lookup a
    second, not one per scrape)."""

    PERIOD_S = 1.0
    DOWN_PERIOD_S = 0.2
    PING_TIMEOUT_S = 1.0
    PING_TIMEOUT_UP_S = 5.0  # asked in the background while up: a busy engine is slow to answer, not gone
    ACTORS_TTL_S = 1.0

    def __init__(self, app_name: str, min_engines: int) -> None:
        self.prefix = f"engine:{app_name}:"
        self.min_engines = min_engines
        self._num_up = 0
        self._up_names: set[str] = set()  # the engines that answered at the last asking
        self._checked_at = -math.inf
        self._lock: asyncio.Lock | None = None
        self._refreshing: asyncio.Task | None = None
        self._handles: dict[str, object] = {}
        self._listed_at = -math.inf
        self._list_lock: asyncio.Lock | None = None

    def recheck(self) -> None:
        """Ask again on the next call (an engine was seen to stop)."""
        self._checked_at = -math.inf
        self._listed_at = -math.inf

    async def available(self) -> bool:
        if self.min_engines == 0:
            return True
        return await self.num_up() > 0

    def _fresh(self) -> bool:
        period = self.PERIOD_S if self._num_up else self.DOWN_PERIOD_S
        return time.monotonic() - self._checked_at < period

    async def num_up(self) -> int:
        """How many engines answer. While some did at the last asking, that count is answered at once
        and they are asked again in the background: a lookup and pings take long on a busy cluster
        (hundreds of ms under a burst), and every request waited for them; an engine busy with a burst
        is given ``PING_TIMEOUT_UP_S`` to answer there (at 1 s a burst made it look gone: 503
        engine_unavailable). While none did, or once an engine was seen to stop (``recheck``),
        callers wait for the fresh answer, with ``PING_TIMEOUT_S``."""
        if self._fresh():
            return self._num_up
        if self._num_up and self._checked_at > -math.inf:
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.get_running_loop().create_task(
                    self._check(self.PING_TIMEOUT_UP_S, slow_is_up=True),
                    context=contextvars.Context())  # not a request's child
            return self._num_up
        await self._check(self.PING_TIMEOUT_S)
        return self._num_up

    async def _check(self, timeout_s: float, slow_is_up: bool = False) -> None:
        """Ask every engine ``ready``. With ``slow_is_up`` (the background asking while engines are up),
        one that answered last time and gives no answer within ``timeout_s`` still counts: it is busy,
        not gone (on a 2-core machine under load a busy engine took over 5 s, and the Ingress turned
        requests away as overloaded while it streamed). One that fails (its actor died, its engine gave
        up) or left the named actors does not count, nor one not yet seen to answer (still starting)."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # one lookup for every request that arrives meanwhile
            if not self._fresh():
                actors = await self.actors(max_age_s=0.0)
                answers = await asyncio.gather(*(self._ping(a, timeout_s) for a in actors.values()))
                was_up = self._up_names if slow_is_up else set()
                self._up_names = {name for name, answer in zip(actors, answers)
                                  if answer or (answer is None and name in was_up)}
                self._num_up, self._checked_at = len(self._up_names), time.monotonic()

    async def actors(self, max_age_s: float | None = None) -> dict[str, object]:
        """The app's scheduler actors, ``{name: handle}``, looked up on a thread at most every
        ``max_age_s`` (default ``ACTORS_TTL_S``)."""
        max_age_s = self.ACTORS_TTL_S if max_age_s is None else max_age_s
        if time.monotonic() - self._listed_at < max_age_s:
            return self._handles
        self._list_lock = self._list_lock or asyncio.Lock()
        async with self._list_lock:  # callers arriving meanwhile share the lookup under way
            if time.monotonic() - self._listed_at >= max_age_s:
                started = time.monotonic()
                self._handles = await asyncio.get_running_loop().run_in_executor(None, self._actors)
                self._listed_at = started
        return self._handles

    def _actors(self) -> dict[str, object]:
        """Ray's blocking lookups (run on a thread)."""
        actors = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == ENGINE_NAMESPACE and entry["name"].startswith(self.prefix):
                try:
                    actors[entry["name"]] = ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE)
                except ValueError:  # gone between the listing and the lookup
                    pass
        return actors

    async def _ping(self, actor, timeout_s: float) -> bool | None:
        """True: it answered; None: no answer within ``timeout_s`` (busy or still starting); False: it
        failed (dead, or its engine gave up on its ranks)."""
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - dead or gave up
            return False


class EngineGate:
    """ASGI middleware of the Ingress's HTTP app: /health, /v1/models and the generating routes
    answer 503, with an OpenAI error body, while no engine serves (a key still guards all but /health:
    a bad one gets the app's 401), and the generating routes 503 ``engine_overloaded`` while the
    engines are full (``full(inside)``: Serve's router would refuse the request, counting the
    generating requests let through and not yet answered). A refused completion is
    answered here, before its body is read and parsed: while a replica is replaced, clients retrying
    would otherwise spend the CPU the new replica needs to start, and under a burst each refusal waited
    for the parsing and tokenizing of every request before it. Every 503 the app sends (queue full,
    no engine, an engine restarting) carries Retry-After, and every response ``Server-Timing:
    ingress;dur=<ms>``: the time from its arrival here until its answer began (and, for a route the
    gate checks, ``gate;dur=<ms>``: the part of it until the gate had decided)."""

    GATED = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")
    GENERATING = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, available, api_key: str | None, full=None) -> None:
        self.app, self.available, self.api_key, self.full = app, available, api_key, full
        self.inside = 0  # generating requests let through and not yet answered in full

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.monotonic()

        decided = None  # when the gate had decided (its part of the Ingress's time)

        async def send_timed(message) -> None:  # Server-Timing: the Ingress's time until the answer began
            if message["type"] == "http.response.start":
                timing = f"ingress;dur={1000 * (time.monotonic() - arrived):.1f}"
                if decided is not None:
                    timing += f", gate;dur={1000 * (decided - arrived):.1f}"
                timing = timing.encode()
                message = {**message, "headers": [*message.get("headers", []), (b"server-timing", timing)]}
            await send(message)

        refusal = None
        if scope["path"] in self.GATED and self._authorized(scope):
            if not await self.available():
                refusal = EngineUnavailableError(NO_ENGINE)
            elif scope["path"] in self.GENERATING and self.full is not None and await self.full(self.inside):
                refusal = OpenAIError(503, OVERLOADED_MESSAGE, "server_error", code="engine_overloaded")
            decided = time.monotonic()
        if refusal is not None:
            response = JSONResponse(refusal.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send_timed)
            return

        async def send_with_retry_after(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
            await send_timed(message)

        generating = scope["path"] in self.GENERATING
        self.inside += generating  # each will call the engines once at least: a burst counts at once,
        try:  # not only once its requests were parsed and tokenized
            await self.app(scope, receive, send_with_retry_after)
        finally:
            self.inside -= generating

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] == "/health":
            return True
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())
