"""The Ingress's engine client (``ServeEngineClient``): what the OpenAI and gRPC layers of an Ingress
replica call to run a request on the LLMServer deployment.

    generate(label, ids, params) ── LLMServer handle .generate(engine id, ..., subscriber) ──► replica
         ▲                             (Serve routes, counts, queues or refuses it)         admits into
         └── this replica's queue ◄── _pump: one stream per scheduler actor ◄── its engine's deltas

The engine id of every call is made here; a caller's id is only its label. ``full`` says when Serve's
router would refuse one more call, so that the Ingress refuses it at once (EngineGate).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import uuid

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cluster.engine_gate import NO_ENGINE, EngineWatch
from cluster.llm_server import ENGINE_NAMESPACE, ENGINE_STOPPED, EngineUnavailableError, _cause
from engine import EngineOverloadedError, SamplingParams
from engine.messages import merge_outputs
from engine.sampling_params import RequestOutputKind

logger = logging.getLogger("ray.serve")


FULL = "every replica is at its queue bound; retry later"


def new_engine_id() -> str:
    """The engine's id of one request: always made here, never a caller's (a caller's id is a label)."""
    return f"req-{uuid.uuid4().hex}"


class ServeEngineClient:
    """The engine client of the OpenAI and gRPC layers in an Ingress replica.

    A request goes through the LLMServer handle (so Serve routes, counts and autoscales it); the
    replica answers with the name of its scheduler actor, and the deltas arrive on one multiplexed
    stream per scheduler actor, subscribed once per Ingress replica: one Ray object per engine step
    instead of one per token per request.

    The ``request_id`` a caller passes is only its label: every call gets its own engine id
    (``new_engine_id``), under which its queue is kept and the engine knows it, so two calls with one
    label (a gRPC client's reused id) neither share outputs nor remove each other's queue.
    """

    def __init__(self, handle: DeploymentHandle, engines: EngineWatch,
                 limits: tuple[int, int] | None = None) -> None:
        self.handle = handle
        self.engines = engines
        self.limits = limits  # the LLMServer deployment's (max_ongoing_requests, max_queued_requests)
        self.in_flight = 0  # calls made on the handle and not yet ended: running, or queued by its router
        self.subscriber = f"ingress-{uuid.uuid4().hex}"
        self._queues: dict[str, asyncio.Queue] = {}  # by engine id
        self._engine_of: dict[str, str] = {}  # engine id -> the scheduler actor's name
        self._subscriptions: dict[str, asyncio.Task] = {}
        self._actors: dict[str, object] = {}  # scheduler actor name -> handle (looked up by its stream)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None):
        if not await self.engines.available():  # else the request would wait for a replica that may never come
            raise EngineUnavailableError(NO_ENGINE)
        if await self.full():
            raise EngineOverloadedError(FULL)
        engine_id = new_engine_id()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[engine_id] = queue
        call = self.handle.options(stream=True).generate.remote(
            engine_id, prompt_token_ids, params, cache_salt=cache_salt, subscriber=self.subscriber)
        self.in_flight += 1
        finished = False
        engine_name = None
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
                raise EngineOverloadedError(FULL) from None
            self._engine_of[engine_id] = engine_name
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
            self.in_flight -= 1
            self._queues.pop(engine_id, None)
            self._engine_of.pop(engine_id, None)
            if not finished:  # the caller left: cancelling reaches the replica, which aborts
                call.cancel()
                actor = self._actors.get(engine_name)
                if actor is not None:  # and the engine hears it at once
                    actor.abort.remote(engine_id)

    async def full(self, coming: int = 0) -> bool:
        """Whether Serve's router would refuse one more call: this Ingress alone has as many in flight
        (or ``coming``: requests let in that will each make one call at least) as every serving
        replica takes plus what the router queues (with other Ingress replicas the replicas hold
        more). Known here, a refusal costs nothing: without it, under a burst each refused request was
        read, parsed and tokenized on this loop, among the streams, before the router said no
        (seconds, at 300 requests at once against one replica)."""
        if self.limits is None or self.limits[1] < 0:  # max_queued_requests -1: the router queues without bound
            return False
        max_ongoing, max_queued = self.limits
        calls = max(self.in_flight, coming)
        if calls < max_ongoing + max_queued:  # not even one replica's worth: no need to count them
            return False
        return calls >= await self.engines.num_up() * max_ongoing + max_queued

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
            engine = await asyncio.get_running_loop().run_in_executor(  # a blocking GCS lookup: off the loop
                None, functools.partial(ray.get_actor, engine_name, namespace=ENGINE_NAMESPACE))
            self._actors[engine_name] = engine
            async for ref in engine.subscribe.remote(self.subscriber):
                for engine_id, item in await ref:
                    queue = self._queues.get(engine_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - every request of that engine fails with it
            logger.warning("the stream of %s ended: %s", engine_name, type(exc).__name__)
            self._actors.pop(engine_name, None)
            self.engines.recheck()
            error = EngineUnavailableError(ENGINE_STOPPED + " while serving this request; retry shortly")
            for engine_id, name in list(self._engine_of.items()):
                if name == engine_name and engine_id in self._queues:
                    self._queues[engine_id].put_nowait(error)

    async def abort(self, request_id: str) -> None:
        """Nothing to do: a request ends with its ``generate`` stream, whose closing cancels the
        replica's call (which aborts it) and tells the engine directly. ``request_id`` is a caller's
        label, which another request may carry too: it never names an engine entry."""
