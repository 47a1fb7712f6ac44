"""The Ingress's engine client (``serve_app.ServeEngineClient``) over real engines, without Ray: each
"replica" is the real ``LLMServer.generate`` on a real ``SchedulerActor`` built in this process, and
the Ray and Serve handles between them are stand-ins with the same shapes:

    ServeEngineClient ── FakeLLMServerHandle ──► FakeCall (Serve's streaming call: a task driving
                                                  LLMServer.generate; cancel() cancels that task)
                      ◄── InProcessActor.subscribe ── SchedulerActor (add_request, abort, subscribe)

Everything runs on the caller's event loop (the module's ``run``). ``delays`` make an actor method
wait before it runs: the trip of a call to a busy actor.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools

from ray.exceptions import RayTaskError

from cluster.llm_server import LLMServer
from cluster.scheduler_actor import SchedulerActor
from engine import engine_config


def ray_task_error(cause: Exception) -> Exception:
    """What a Ray call raises when the remote method raised ``cause`` (an instance of its class)."""
    return RayTaskError("SchedulerActor.method", "Traceback (most recent call last):\n  ...", cause,
                        pid=4242, ip="10.1.2.3").as_instanceof_cause()


_CALLS: set[asyncio.Task] = set()  # calls in flight (the loop keeps only weak references)


class _Method:
    def __init__(self, fn, delay_s: float) -> None:
        self.fn, self.delay_s = fn, delay_s

    def remote(self, *args, **kwargs):
        if inspect.isasyncgenfunction(self.fn):
            return _RefGenerator(self.fn(*args, **kwargs))
        # the call runs whatever becomes of its ref: cancelling a caller that awaits the ref (a plain
        # future) does not cancel the call, as with Ray
        task = asyncio.ensure_future(self._call(*args, **kwargs))
        ref = asyncio.get_running_loop().create_future()

        def resolve(done: asyncio.Task) -> None:
            if ref.done():
                return
            if done.cancelled():
                ref.cancel()
            elif done.exception() is not None:
                ref.set_exception(done.exception())
            else:
                ref.set_result(done.result())

        task.add_done_callback(resolve)
        _CALLS.add(task)
        task.add_done_callback(_CALLS.discard)
        return ref

    async def _call(self, *args, **kwargs):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            result = self.fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:
            raise ray_task_error(exc) from None


class _RefGenerator:
    """Ray's ObjectRefGenerator: an async iterator of awaitable refs."""

    def __init__(self, gen) -> None:
        self.gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.gen.__anext__()
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        return ref


class InProcessActor:
    """``actor.method.remote(...)`` on a local object, as on a Ray actor handle."""

    def __init__(self, obj, delays: dict[str, float] | None = None) -> None:
        self.obj, self.delays = obj, delays or {}

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name), self.delays.get(name, 0.0))


class FakeCall:
    """Serve's DeploymentResponseGenerator for a call to ``LLMServer.generate``: a task drives the
    replica's generator; the replica's exceptions arrive as Ray's RayTaskError; ``cancel()`` cancels
    the replica's task (as Serve does), raising CancelledError where the generator waits."""

    def __init__(self, gen) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._drive(gen))
        self.cancelled = False

    async def _drive(self, gen) -> None:
        try:
            async for item in gen:
                self._items.put_nowait(("item", item))
            self._items.put_nowait(("end", None))
        except Exception as exc:
            self._items.put_nowait(("error", ray_task_error(exc)))

    async def __anext__(self):
        kind, value = await self._items.get()
        if kind == "item":
            return value
        if kind == "end":
            raise StopAsyncIteration
        raise value

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()


class FakeLLMServerHandle:
    """The LLMServer deployment's handle: calls go to the replicas in turn."""

    def __init__(self, replicas: list[LLMServer]) -> None:
        self.replicas = replicas
        self._next = itertools.cycle(replicas)
        self.calls: list[FakeCall] = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        handle = self

        class _Generate:
            @staticmethod
            def remote(*args, **kwargs) -> FakeCall:
                call = FakeCall(next(handle._next).generate(*args, **kwargs))
                handle.calls.append(call)
                return call

        return _Generate


class AlwaysUp:
    """EngineWatch's shape: an engine always serves."""

    async def available(self) -> bool:
        return True

    def recheck(self) -> None:
        pass


def replica(model_dir: str, name: str, delays: dict[str, float] | None = None, **settings) -> LLMServer:
    """A real LLMServer (its request path) on a real SchedulerActor in this process, named ``name``."""
    actor = InProcessActor(SchedulerActor(engine_config(model_dir, **settings)), delays)
    server = object.__new__(LLMServer)
    server.engine, server.engine_name = actor, name
    server._dead = server._restarting = None
    server._aborting = set()
    return server


async def shutdown(replicas: list[LLMServer]) -> None:
    for server in replicas:
        await server.engine.obj.shutdown()
