"""The Ray Serve application: `serve run serve_app:app model=DIR tensor_parallel_size=N ...`.

    client ──HTTP/SSE──► Ingress (FastAPI: api/http_app.py + api/openai_serving.py)
           ──gRPC──────► Ingress.Generate / GenerateStream (api/grpc_serving.py)
           ──handle────► Ingress.generate / generate_stream
                            │  DeploymentHandle, prefix-aware router (cluster/router.py)
                            ▼
                       LLMServer replica ── owns ──► SchedulerActor (+ worker actors when tp > 1)
                                                     all in the replica's placement group

Each LLMServer replica reserves one placement group: its own bundle, the engine's bundle (the
scheduler actor, which also holds the model at tp = 1), and one bundle per rank at tp > 1; Serve
scales replicas with these resources accounted. The reservations are sized for the cluster the app
will run on (`plan_reservations`): where the CPUs are too few for the replica, the scheduler actor
and the Ingress to have bundles of their own, they take none and share the engine's or rank 0's,
and a request that cannot fit at all stops the build with the setting to change.

Failures: a replica rebuilds a scheduler actor that died in place (``max_engine_restarts``), after
which its health check fails and Serve replaces it. While no engine can take a request (restarting,
replaced, not placed) the Ingress answers 503 ``engine_unavailable`` with Retry-After (gRPC
UNAVAILABLE), and /health and /v1/models answer 503, rather than leaving requests waiting.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from pydantic import ValidationError
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from api import grpc_serving
from api.engine_client import OpenAIError
from api.http_app import build_openai_app, validation_error
from api.metrics import prometheus_text
from api.openai_protocol import ChatCompletionRequest, CompletionRequest
from api.openai_serving import OpenAIServing
from cluster.app_args import ENGINE_KWARGS, AppArgs, _with_options, api_key_from_env, api_key_from_file
from cluster.scheduler_actor import launch_scheduler_actor
from engine import EngineDeadError, EngineOverloadedError, SamplingParams, engine_config
from engine.config import EngineConfig, ModelConfig
from engine.messages import RequestOutput, merge_outputs
from engine.sampling_params import RequestOutputKind
from engine.tokenizer import Tokenizer
from workers.model_source import localize_model

ENGINE_NAMESPACE = "kvserve"
ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
ENGINE_START_TIMEOUT_S = 600.0
NAME_RELEASE_S = 10.0  # how long a rebuilt engine waits for its dead predecessor's name
RETRY_AFTER_S = 2  # the Retry-After of every 503
ENGINE_STOPPED = "the engine stopped"
NO_ENGINE = "no engine replica is serving yet (starting, restarting or waiting for resources); retry shortly"

logger = logging.getLogger("ray.serve")


class EngineUnavailableError(OpenAIError, EngineDeadError):
    """No engine can take the request now, but one is (re)starting: HTTP 503 with Retry-After, gRPC
    UNAVAILABLE. Raised while a replica's scheduler actor is being rebuilt, while no engine replica of
    the application answers, and to the requests in flight on an engine that died."""

    def __init__(self, message: str) -> None:
        OpenAIError.__init__(self, 503, message, "server_error", code="engine_unavailable")


def _cause(exc: RayTaskError) -> BaseException:
    """The exception a remote call raised, without Ray's wrapping (task names, pids, tracebacks); an
    engine that died under it becomes EngineUnavailableError."""
    cause = exc.cause
    if isinstance(cause, RayActorError):
        return EngineUnavailableError(ENGINE_STOPPED)
    return cause if isinstance(cause, Exception) else exc


def _engine_gave_up(error: BaseException) -> bool:
    """The engine runs but gave up on its ranks (not one that stopped: that is EngineUnavailableError)."""
    return isinstance(error, EngineDeadError) and not isinstance(error, EngineUnavailableError)


class LLMServer:
    """One engine instance: starts its scheduler actor (and ranks) in this replica's placement group.

    A scheduler actor that dies is noticed by the next call to it (a request, the routing-stats
    refresh every second, the health check) and rebuilt in place, in the same bundles, up to
    ``max_engine_restarts`` times; meanwhile requests are refused with EngineUnavailableError. A
    rebuild that fails, one more death, or an engine that gave up on its ranks (EngineDeadError:
    ``max_worker_restarts`` spent) makes ``check_health`` fail: Serve then replaces the replica (and
    its placement group)."""

    async def __init__(self, config: EngineConfig, args: AppArgs, use_gpu: bool, plan: Reservations) -> None:
        ctx = serve.get_replica_context()
        tp = config.parallel.tensor_parallel_size
        self.engine_name = f"engine:{ctx.app_name}:{ctx.replica_tag}"
        self._config = config
        self._launch_options = dict(
            placement_group=ray.util.get_current_placement_group(), bundle_index=plan.engine_bundle,
            first_rank_bundle=plan.first_rank_bundle, num_cpus=plan.engine_cpus,
            num_gpus=1 if use_gpu and tp == 1 else 0,
            name=self.engine_name, namespace=ENGINE_NAMESPACE,
            max_waiting_requests=args.max_waiting_requests,
            torch_threads=(args.torch_threads or max(1, int(args.engine_cpus))) if tp == 1 else None,
        )
        self.max_engine_restarts = args.max_engine_restarts
        self.num_engine_restarts = 0
        self._restarting: asyncio.Task | None = None
        self._dead: str | None = None  # why this replica can serve no more (its health check fails)
        self._ranks: list | None = None  # the engine's rank actors, started here (tp > 1)
        self.engine = await self._start_engine()
        self._routing_stats: dict = {}
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_routing_stats())

    async def _start_engine(self):
        # at tensor_parallel_size > 1 the ranks start here, their processes booting beside the
        # scheduler actor's instead of after it (the actor takes them; this replica owns them)
        from cluster.worker_group import spawn_ranks  # (no torch: the ranks import it)

        pg, first = self._launch_options["placement_group"], self._launch_options["first_rank_bundle"]
        tp = self._config.parallel.tensor_parallel_size
        self._ranks = spawn_ranks(self._config, pg, first) if tp > 1 and pg is not None else None
        deadline = time.monotonic() + NAME_RELEASE_S
        try:
            while True:
                try:
                    actor = launch_scheduler_actor(self._config, **self._launch_options, ranks=self._ranks, wait=False)
                    break
                except ValueError as exc:  # the name of an engine that just died is released a moment later
                    if "already taken" not in str(exc) or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)
        except BaseException:
            self._kill_ranks()
            raise
        try:
            await actor.ready.remote()
        except BaseException:
            ray.kill(actor, no_restart=True)
            self._kill_ranks()
            raise
        return actor

    def _kill_ranks(self) -> None:
        """The ranks this replica started for its engine (after the engine itself died, they would
        keep their bundles)."""
        for rank in self._ranks or ():
            ray.kill(rank, no_restart=True)
        self._ranks = None

    def _live_engine(self):
        """The engine, or EngineUnavailableError while there is none to serve."""
        if self._dead is not None:
            raise EngineUnavailableError(f"{ENGINE_STOPPED} ({self._dead}); a new replica is starting")
        if self._restarting is not None:
            raise EngineUnavailableError("the engine is restarting; retry shortly")
        return self.engine

    def _engine_died(self, engine, exc: BaseException) -> None:
        """``engine`` answered a call with ``exc``: if it died, rebuild it (once per death)."""
        if not isinstance(exc, ActorDiedError) or engine is not self.engine:
            return  # a transient error, or news of an engine already replaced
        if self._restarting is not None or self._dead is not None:
            return
        if self.num_engine_restarts >= self.max_engine_restarts:
            self._dead = f"the engine died after max_engine_restarts={self.max_engine_restarts} restarts"
            logger.error("%s: %s", self.engine_name, self._dead)
            return
        logger.warning("%s died; starting a new one in the same bundles", self.engine_name)
        self._restarting = asyncio.get_running_loop().create_task(
            self._restart_engine(engine), context=contextvars.Context())  # not a child of a request's task

    def _engine_is_dead(self, engine, error: BaseException) -> None:
        """``engine`` runs but can serve no more (it gave up on its ranks): the health check fails."""
        if engine is self.engine and self._dead is None:
            self._dead = f"the engine is dead: {error}"
            logger.error("%s: %s", self.engine_name, self._dead)

    async def _restart_engine(self, dead) -> None:
        self.num_engine_restarts += 1
        started = time.monotonic()
        try:
            ray.kill(dead, no_restart=True)
            self._kill_ranks()
            self.engine = await asyncio.wait_for(self._start_engine(), timeout=ENGINE_START_TIMEOUT_S)
            logger.warning("%s serves again after %.1fs", self.engine_name, time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - reported by the health check, which makes Serve replace us
            self._dead = f"the engine could not be restarted: {type(exc).__name__}"
            logger.error("%s: %s", self.engine_name, self._dead, exc_info=exc)
        finally:
            self._restarting = None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, subscriber: str = ""):
        """Admit the request into this replica's engine and yield the engine's actor name: the outputs
        flow from that actor to ``subscriber`` on its multiplexed stream. The call stays open until the
        request ends, so Serve counts it as ongoing here; cancelled first, it aborts the request."""
        engine = self._live_engine()
        try:
            await engine.add_request.remote(request_id, prompt_token_ids, params, cache_salt, subscriber)
        except RayTaskError as exc:
            cause = _cause(exc)
            if _engine_gave_up(cause):  # its ranks are given up on: a new replica is needed
                self._engine_is_dead(engine, cause)
                raise EngineUnavailableError(f"{ENGINE_STOPPED}; a new replica is starting") from None
            raise cause from None
        except RayActorError as exc:
            self._engine_died(engine, exc)
            raise EngineUnavailableError(ENGINE_STOPPED + "; retry shortly") from None
        finished = False
        try:
            yield self.engine_name
            await engine.wait_finished.remote(request_id)
            finished = True
        except RayActorError as exc:  # the request's own stream reports it to the Ingress
            finished = True
            self._engine_died(engine, exc)
        finally:
            if not finished:
                engine.abort.remote(request_id)

    async def _refresh_routing_stats(self) -> None:
        while True:
            engine = self.engine
            try:
                if self._restarting is None and self._dead is None:
                    self._routing_stats = await engine.routing_stats.remote()
            except Exception as exc:  # noqa: BLE001 - a dead engine is rebuilt, or reported by the health check
                self._engine_died(engine, exc)
            await asyncio.sleep(ROUTING_STATS_PERIOD_S)

    def record_routing_stats(self) -> dict:
        return self._routing_stats

    async def stats(self) -> dict:
        return await self._live_engine().stats.remote()

    async def placement(self) -> dict:
        """Placement group ids of this replica, its scheduler actor and its ranks."""
        return {"replica": ray.get_runtime_context().get_placement_group_id(),
                **await self._live_engine().placement.remote()}

    async def check_health(self) -> None:
        """Serve's health check: fails when the engine is dead for good (Serve then replaces this
        replica) or does not answer; passes while a rebuild is under way."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if self._restarting is not None:
            return
        engine = self.engine
        try:
            await asyncio.wait_for(engine.ready.remote(), timeout=HEALTH_CHECK_TIMEOUT_S)
        except RayTaskError as exc:
            cause = _cause(exc)
            if _engine_gave_up(cause):
                self._engine_is_dead(engine, cause)
            raise RuntimeError(self._dead or f"the engine's health check failed: {type(cause).__name__}") from None
        except RayActorError as exc:
            self._engine_died(engine, exc)
            if self._dead is not None or self._restarting is None:
                raise RuntimeError(self._dead or f"the engine does not answer: {type(exc).__name__}") from None


class ServeEngineClient:
    """The engine client of the OpenAI and gRPC layers in an Ingress replica.

    A request goes through the LLMServer handle (so Serve routes, counts and autoscales it); the
    replica answers with the name of its scheduler actor, and the deltas arrive on one multiplexed
    stream per scheduler actor, subscribed once per Ingress replica: one Ray object per engine step
    instead of one per token per request.
    """

    def __init__(self, handle: DeploymentHandle, engines: EngineWatch) -> None:
        self.handle = handle
        self.engines = engines
        self.subscriber = f"ingress-{uuid.uuid4().hex}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._engine_of: dict[str, str] = {}
        self._subscriptions: dict[str, asyncio.Task] = {}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None):
        if not await self.engines.available():  # else the request would wait for a replica that may never come
            raise EngineUnavailableError(NO_ENGINE)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        call = self.handle.options(stream=True).generate.remote(
            request_id, prompt_token_ids, params, cache_salt=cache_salt, subscriber=self.subscriber)
        finished = False
        try:
            try:
                engine_name = await call.__anext__()
            except RayTaskError as exc:  # refused by the replica or its engine: nothing to cancel
                finished = True
                raise _cause(exc) from None
            except RayActorError:  # the replica died under the call
                finished = True
                self.engines.recheck()
                raise EngineUnavailableError(ENGINE_STOPPED + "; retry shortly") from None
            except BackPressureError:  # refused by Serve's router
                finished = True
                raise EngineOverloadedError("every replica is at its queue bound; retry later") from None
            self._engine_of[request_id] = engine_name
            self._subscribe(engine_name)
            while not finished:
                item = await queue.get()
                while not isinstance(item, BaseException) and not queue.empty():
                    nxt = queue.get_nowait()  # the reader fell behind: one merged delta
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt, RequestOutputKind.DELTA)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self._engine_of.pop(request_id, None)
            if not finished:  # the caller left: cancelling reaches the replica, which aborts
                call.cancel()

    def _subscribe(self, engine_name: str) -> None:
        task = self._subscriptions.get(engine_name)
        if task is None or task.done():
            # a fresh context: a subscription started while serving one request must not be a child of
            # that request's task, or cancelling the request (a client that left) would cancel it too
            self._subscriptions[engine_name] = asyncio.get_running_loop().create_task(
                self._pump(engine_name), context=contextvars.Context())

    async def _pump(self, engine_name: str) -> None:
        """Route the engine's batches to the waiting requests until the engine goes away."""
        try:
            engine = ray.get_actor(engine_name, namespace=ENGINE_NAMESPACE)
            async for ref in engine.subscribe.remote(self.subscriber):
                for request_id, item in await ref:
                    queue = self._queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - every request of that engine fails with it
            logger.warning("the stream of %s ended: %s", engine_name, type(exc).__name__)
            self.engines.recheck()
            error = EngineUnavailableError(ENGINE_STOPPED + " while serving this request; retry shortly")
            for request_id, name in list(self._engine_of.items()):
                if name == engine_name and request_id in self._queues:
                    self._queues[request_id].put_nowait(error)

    async def abort(self, request_id: str) -> None:
        engine_name = self._engine_of.get(request_id)
        if engine_name is not None:
            ray.get_actor(engine_name, namespace=ENGINE_NAMESPACE).abort.remote(request_id)


class EngineWatch:
    """Whether an engine of this application serves: its scheduler actors (named
    ``engine:<app>:<replica>``) are asked ``ready``, at most once a second. While an application that
    keeps at least one replica (``min_engines`` > 0; autoscaling from zero has none to ask) has no
    engine answering, the Ingress refuses requests with 503 instead of leaving them waiting for a
    replica that is starting, being replaced, or cannot be placed. While none answers it asks
    every ``DOWN_PERIOD_S``, so that a replica that comes back is used within that time."""

    PERIOD_S = 1.0
    DOWN_PERIOD_S = 0.2
    PING_TIMEOUT_S = 1.0

    def __init__(self, app_name: str, min_engines: int) -> None:
        self.prefix = f"engine:{app_name}:"
        self.min_engines = min_engines
        self._num_up = 0
        self._checked_at = -math.inf
        self._lock: asyncio.Lock | None = None

    def recheck(self) -> None:
        """Ask again on the next call (an engine was seen to stop)."""
        self._checked_at = -math.inf

    async def available(self) -> bool:
        if self.min_engines == 0:
            return True
        return await self.num_up() > 0

    def _fresh(self) -> bool:
        period = self.PERIOD_S if self._num_up else self.DOWN_PERIOD_S
        return time.monotonic() - self._checked_at < period

    async def num_up(self) -> int:
        if self._fresh():
            return self._num_up
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # one lookup for every request that arrives meanwhile
            if not self._fresh():
                actors = await asyncio.get_running_loop().run_in_executor(None, self._actors)
                answers = await asyncio.gather(*(self._ping(a) for a in actors))
                self._num_up, self._checked_at = sum(answers), time.monotonic()
        return self._num_up

    def _actors(self) -> list:
        actors = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == ENGINE_NAMESPACE and entry["name"].startswith(self.prefix):
                try:
                    actors.append(ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE))
                except ValueError:  # gone between the listing and the lookup
                    pass
        return actors

    async def _ping(self, actor) -> bool:
        try:
            await asyncio.wait_for(actor.ready.remote(), timeout=self.PING_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - dead, still starting, or not answering
            return False


class EngineGate:
    """ASGI middleware of the Ingress's HTTP app: /health, /v1/models and the generating routes
    answer 503, with an OpenAI error body, while no engine serves (a key still guards all but /health:
    a bad one gets the app's 401). A refused completion is answered here, before its body is read and
    parsed: while a replica is replaced, clients retrying would otherwise spend the CPU the new
    replica needs to start. Every 503 the app sends (queue full, no engine, an engine restarting)
    carries Retry-After."""

    GATED = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")

    def __init__(self, app, available, api_key: str | None) -> None:
        self.app, self.available, self.api_key = app, available, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] in self.GATED and self._authorized(scope) and not await self.available():
            body = EngineUnavailableError(NO_ENGINE).body()
            response = JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
            await response(scope, receive, send)
            return

        async def send_with_retry_after(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)

    def _authorized(self, scope) -> bool:
        if self.api_key is None or scope["path"] == "/health":
            return True
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())


class Ingress:
    """HTTP (OpenAI API), gRPC and Python-handle entry point of the application."""

    def __init__(self, llm_server: DeploymentHandle, model: ModelConfig, served_model_name: str,
                 max_model_len: int, api_key: str | None, stream_interval: int = 1, min_engines: int = 1,
                 api_key_env: str | None = None, api_key_file: str | None = None,
                 tool_call_parser: str = "generic") -> None:
        self.tokenizer = Tokenizer(localize_model(model).path)  # the checkpoint's copy on this node
        self.app_name = serve.get_replica_context().app_name
        self.engines = EngineWatch(self.app_name, min_engines)
        self.client = ServeEngineClient(llm_server, self.engines)
        self.serving = OpenAIServing(self.client, self.tokenizer, served_model_name, max_model_len, stream_interval,
                                     tool_call_parser=tool_call_parser)
        self.served_model_name = served_model_name
        self.api_key = api_key_from_env(api_key_env) if api_key_env is not None else \
            api_key_from_file(api_key_file) if api_key_file is not None else api_key

    def __serve_build_asgi_app__(self):
        app = build_openai_app(lambda: self.serving, api_key=self.api_key, metrics_text=self.metrics_text,
                               kv_map=self.kv_map)
        app.add_middleware(EngineGate, available=self.engines.available, api_key=self.api_key)
        return app

    async def metrics_text(self) -> str:
        """Prometheus text (prometheus_client's exposition, api/metrics.py) for every LLMServer
        replica of this application, labelled by replica."""
        return prometheus_text(await self._ask_engines("stats"), self.served_model_name)

    async def kv_map(self) -> dict:
        """The KV-cache map (engine/kv_map.py) of every LLMServer replica's engine, by replica (the
        /metrics label)."""
        return await self._ask_engines("kv_map")

    async def _ask_engines(self, method: str) -> dict:
        """``method``'s answer from every scheduler actor of this application, by replica."""
        prefix = f"engine:{self.app_name}:"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == ENGINE_NAMESPACE and a["name"].startswith(prefix)]

        async def ask(name: str):
            try:
                actor = ray.get_actor(name, namespace=ENGINE_NAMESPACE)
                return await asyncio.wait_for(getattr(actor, method).remote(), timeout=5)
            except Exception:  # noqa: BLE001 - a replica going away between list and call
                return None

        results = await asyncio.gather(*(ask(n) for n in names))
        return {n.removeprefix(prefix): r for n, r in zip(names, results) if r is not None}

    # --- Python handles: serve.get_app_handle(name).generate.remote(...) ---------------------------

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None,
                       cache_salt: str | None = None) -> RequestOutput:
        """The final output of one request (prompt text or token ids)."""
        final = None
        async for delta in self.generate_stream(prompt, sampling_params, cache_salt):
            final = delta if final is None else _accumulate(final, delta)
        return final

    async def generate_stream(self, prompt: str | list[int], sampling_params: SamplingParams | dict | None = None,
                              cache_salt: str | None = None):
        """Output deltas of one request, for `handle.options(stream=True).generate_stream.remote(...)`."""
        params = sampling_params if isinstance(sampling_params, SamplingParams) else \
            SamplingParams(**(sampling_params or {}))
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        async for delta in self.client.generate(f"handle-{uuid.uuid4().hex}", token_ids, params, cache_salt):
            yield delta

    # --- Python handles with OpenAI request bodies: handle.completions.remote({"prompt": ...}) -------

    async def completions(self, body: dict) -> dict:
        """An OpenAI completions request body -> the response body the HTTP API would send. Errors
        raise OpenAIError (``.status``, ``.body()`` as over HTTP); a streamed request goes to
        ``completions_stream``."""
        return await self._openai_once(CompletionRequest, self.serving.completions, body)

    async def chat(self, body: dict) -> dict:
        """An OpenAI chat completions request body -> the response body (see ``completions``)."""
        return await self._openai_once(ChatCompletionRequest, self.serving.chat_completions, body)

    async def completions_stream(self, body: dict):
        """The chunks of a streamed completion, as dicts (``handle.options(stream=True)``)."""
        async for chunk in self._openai_stream(CompletionRequest, self.serving.completions, body):
            yield chunk

    async def chat_stream(self, body: dict):
        """The chunks of a streamed chat completion, as dicts (``handle.options(stream=True)``)."""
        async for chunk in self._openai_stream(ChatCompletionRequest, self.serving.chat_completions, body):
            yield chunk

    @staticmethod
    def _openai_request(model, body: dict, stream: bool):
        if not isinstance(body, dict):
            raise OpenAIError.bad_request(f"the request body must be a dict, got {type(body).__name__}")
        given = body.get("stream")
        if given and not stream:
            raise OpenAIError.bad_request("a streamed request goes to the *_stream method", "stream")
        if stream and given is not None and not given:
            raise OpenAIError.bad_request("stream must be true (or absent) for the *_stream method", "stream")
        try:
            return model.model_validate({**body, "stream": stream})
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def _openai_once(self, model, endpoint, body: dict) -> dict:
        return await endpoint(self._openai_request(model, body, stream=False))

    async def _openai_stream(self, model, endpoint, body: dict):
        events = await endpoint(self._openai_request(model, body, stream=True))
        try:
            async for event in events:
                data = event.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                yield json.loads(data)
        finally:
            await events.aclose()

    # --- gRPC (Serve's gRPC proxy calls these by method name) --------------------------------------

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        return await grpc_serving.generate(request, self.client, self.tokenizer, grpc_context, api_key=self.api_key)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        async for response in grpc_serving.generate_stream(request, self.client, self.tokenizer, grpc_context,
                                                           api_key=self.api_key):
            yield response


def _accumulate(total: RequestOutput, delta: RequestOutput) -> RequestOutput:
    return merge_outputs(total, delta, RequestOutputKind.DELTA)


def _use_gpu(device: str, accelerator_type: str | None = None) -> bool:
    """Whether the engines run on GPUs. ``device=auto`` means CUDA when an accelerator_type is given,
    when the Ray cluster has GPUs now, or (Ray not started yet) when this machine has one. A cluster
    whose GPU workers are scaled to zero when the app is built has none now: give device=cuda or an
    accelerator_type there."""
    if device != "auto" or accelerator_type is not None:
        return device == "cuda" or accelerator_type is not None
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


DEFAULT_PROXY_CPUS = 0.5


@dataclass(frozen=True)
class Reservations:
    """What one LLMServer replica reserves (its placement group) and where each actor goes in it."""

    bundles: list[dict[str, float]]
    replica_cpus: float  # the LLMServer replica actor, in bundle 0
    engine_bundle: int  # the scheduler actor's bundle
    engine_cpus: float  # the scheduler actor's CPUs (it runs the model at tp = 1)
    first_rank_bundle: int  # rank r takes bundle first_rank_bundle + r (tp > 1)
    ingress_cpus: float


def cluster_cpus() -> tuple[float, float] | None:
    """(CPUs of the largest node, CPUs of the cluster) where the application will run, or None when
    that cannot be known here. `serve run serve_app:app` builds the app before it starts or joins Ray:
    without RAY_ADDRESS and without a cluster from `ray start` on this machine it starts a local one,
    with the CPUs Ray detects here."""
    try:
        if ray.is_initialized():
            cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
            return (max(cpus), sum(cpus)) if cpus else None
        from ray._private.services import canonicalize_bootstrap_address
        from ray._private.utils import get_num_cpus

        if canonicalize_bootstrap_address(None) is None:
            local = float(get_num_cpus())
            return local, local
    except Exception:  # noqa: BLE001 - an unknown cluster: the default reservations, unchecked
        pass
    return None


def plan_reservations(args: AppArgs, use_gpu: bool, cpus: tuple[float, float] | None) -> Reservations:
    """Each replica's bundles: [replica] + [engine (the model at tp = 1)] or [replica, scheduler] +
    [rank] * tp. The engine (or each rank) takes ``engine_cpus``; the replica, the scheduler actor at
    tp > 1 and the Ingress take ``proxy_cpus``, by default 0.5 or what the cluster leaves over (0
    where it leaves nothing: they then share bundle 0, the engine's or rank 0's). ``cpus`` is (largest
    node, cluster) or None (unknown: nothing is checked). Raises ValueError, naming the setting to
    change, when the reservations cannot fit: a placement group that can never be placed would leave
    every request waiting."""
    tp = args.tensor_parallel_size
    high = args.replica_range[1] if args.autoscaling else (args.num_replicas or 1)
    compute = args.engine_cpus * tp  # the engine at tp = 1, the ranks above
    shared = 1 if tp == 1 else 2  # CPU-less actors beside the compute: the replica (+ the scheduler)
    proxy = args.proxy_cpus
    if cpus is not None:
        node, total = cpus
        per_group = node if args.placement_strategy == "STRICT_PACK" else total
        where = "the largest node" if per_group == node else "the cluster"
        if compute > per_group:
            setting = (f"tensor_parallel_size={tp} with engine_cpus={args.engine_cpus:g} per rank" if tp > 1
                       else f"engine_cpus={args.engine_cpus:g}")
            lower = "tensor_parallel_size (or engine_cpus)" if tp > 1 else "engine_cpus"
            raise ValueError(f"{setting} needs {compute:g} CPUs for one engine but {where} has {per_group:g}: "
                             f"lower {lower}, or run on a bigger node or cluster")
        if compute * high > total:
            raise ValueError(f"{high} replicas need {compute * high:g} CPUs for their engines but the cluster has "
                             f"{total:g}: lower num_replicas / max_replicas (or engine_cpus, tensor_parallel_size)")
        if proxy is None:
            room = min((per_group - compute) / shared, (total - compute * high) / (shared * high + 1))
            proxy = min(DEFAULT_PROXY_CPUS, math.floor(max(room, 0.0) * 100) / 100)
        elif compute + shared * proxy > per_group or (compute + shared * proxy) * high + proxy > total:
            raise ValueError(f"proxy_cpus={proxy:g} leaves too few CPUs for the engines ({total:g} in the cluster, "
                             f"{per_group:g} for one replica): lower proxy_cpus (0 is allowed)")
    elif proxy is None:
        proxy = DEFAULT_PROXY_CPUS
    gpu = {"GPU": 1.0} if use_gpu else {}
    if use_gpu and args.accelerator_type is not None:  # Ray's node label resource for that GPU model
        gpu[f"accelerator_type:{args.accelerator_type}"] = 0.001
    engine = [{"CPU": args.engine_cpus, **gpu}] * tp
    if proxy > 0:
        aux = [{"CPU": proxy}] * shared
        return Reservations(aux + engine, replica_cpus=proxy, engine_bundle=1,
                            engine_cpus=args.engine_cpus if tp == 1 else proxy, first_rank_bundle=shared,
                            ingress_cpus=proxy)
    return Reservations(engine, replica_cpus=0.0, engine_bundle=0, engine_cpus=args.engine_cpus if tp == 1 else 0.0,
                        first_rank_bundle=0, ingress_cpus=0.0)


def build_app(args: AppArgs | dict | None = None):
    """The application for `serve run serve_app:app key=value ...` (and `serve deploy`)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    # every engine setting is a flat app argument of the same name (ENGINE_KWARGS)
    config = engine_config(args.model, revision=args.revision, **{key: getattr(args, key) for key in ENGINE_KWARGS})
    use_gpu = _use_gpu(args.device, args.accelerator_type)
    # GPU engines on a cluster with no GPU node yet (its GPU workers scaled to zero): the autoscaler
    # adds the nodes they need, so the nodes alive now say nothing about where they will fit
    gpus_now = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else None
    plan = plan_reservations(args, use_gpu, None if use_gpu and gpus_now == 0 else cluster_cpus())
    # a repo id is served under its own name (as the hub spells it); a directory under its last component
    served_name = args.served_model_name or config.model.source or Path(config.model.path).name
    options: dict = {
        "name": "LLMServer",
        "ray_actor_options": {"num_cpus": plan.replica_cpus},
        "placement_group_bundles": plan.bundles,
        "placement_group_strategy": args.placement_strategy,
        # a replica takes what its engine can hold (running + waiting); each handle queues as many
        # more while no replica has room, and refuses the rest (BackPressureError -> 503)
        "max_ongoing_requests": args.max_num_seqs + args.max_waiting_requests,
        "max_queued_requests": args.max_num_seqs + args.max_waiting_requests,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S + 5,
    }
    if args.autoscaling:
        low, high = args.replica_range
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high,
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
            # the window the autoscaler averages load over; Serve wants it above its metrics interval (10 s)
            "look_back_period_s": 12.0,
        }
    else:
        options["num_replicas"] = args.num_replicas or 1
    if args.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="cluster.router:PrefixAwareRequestRouter",
            request_router_kwargs={"block_size": args.block_size, "imbalance_threshold": args.router_imbalance},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        )
    options = _with_options(options, args.deployment_config)
    llm_server = serve.deployment(LLMServer).options(**options).bind(config, args, use_gpu, plan)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(**_with_options(
        {"name": "Ingress", "ray_actor_options": {"num_cpus": plan.ingress_cpus}, "max_ongoing_requests": 10_000},
        args.ingress_deployment_config))
    min_engines = args.replica_range[0] if args.autoscaling or "num_replicas" in args.deployment_config \
        else (args.num_replicas or 1)
    if args.api_key_env is not None:
        api_key_from_env(args.api_key_env)  # set where the app is built too: a missing key stops the build
    if args.api_key_file is not None:
        api_key_from_file(args.api_key_file)
    return ingress.bind(llm_server, config.model, served_name, config.max_model_len, args.api_key,
                        args.stream_interval, min_engines, args.api_key_env, args.api_key_file,
                        args.tool_call_parser)


app = build_app
