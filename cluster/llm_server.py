"""The LLMServer deployment: one engine instance (the scheduler actor, and its ranks at tp > 1) in
the replica's placement group, rebuilt in place when the scheduler actor dies.

Kept apart from ``serve_app`` (the Ingress, the HTTP and gRPC layers, ``build_app``) so that a new
LLMServer replica imports only what it runs: after a replica died, the time it takes to start is
time no request is served."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import TYPE_CHECKING

import ray
from ray import serve
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from api.errors import OpenAIError
from cluster.scheduler_actor import launch_scheduler_actor
from engine import EngineDeadError

if TYPE_CHECKING:
    from cluster.app_args import AppArgs
    from cluster.reservations import Reservations
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

ENGINE_NAMESPACE = "kvserve"
ROUTING_STATS_PERIOD_S = 1.0
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
ENGINE_START_TIMEOUT_S = 600.0
NAME_RELEASE_S = 10.0  # how long a rebuilt engine waits for its dead predecessor's name
ENGINE_STOPPED = "the engine stopped"

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
        tp = config.parallel.world_size  # 1: the model runs in the scheduler actor; more: rank actors
        self.engine_name = f"engine:{ctx.app_name}:{ctx.replica_tag}"
        self._config = config
        self._launch_options = dict(
            placement_group=ray.util.get_current_placement_group(), bundle_index=plan.engine_bundle,
            first_rank_bundle=plan.first_rank_bundle, num_cpus=plan.engine_cpus,
            num_gpus=1 if use_gpu and tp == 1 else 0,
            name=self.engine_name, namespace=ENGINE_NAMESPACE,
            max_waiting_requests=args.max_waiting_requests,
            # explicit threads (or engine_cpus) win; else the engine's share of its node's cores
            torch_threads=(args.torch_threads or (max(1, int(args.engine_cpus)) if args.engine_cpus else None)
                           if tp == 1 else None),
            cpu_share=plan.cpu_share if tp == 1 and not args.torch_threads and not args.engine_cpus else None,
            bind_threads=args.bind_threads and not use_gpu and tp == 1,
        )
        self.max_engine_restarts = args.max_engine_restarts
        self.num_engine_restarts = 0
        self._restarting: asyncio.Task | None = None
        self._dead: str | None = None  # why this replica can serve no more (its health check fails)
        self._ranks: list | None = None  # the engine's rank actors, started here (tp > 1)
        self._aborting: set[asyncio.Task] = set()  # aborts of requests cancelled during admission
        self.engine = await self._start_engine()
        self._routing_stats: dict = {}
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_routing_stats())

    async def _start_engine(self):
        # at tensor_parallel_size > 1 the ranks start here, their processes booting beside the
        # scheduler actor's instead of after it (the actor takes them; this replica owns them)
        from cluster.worker_group import spawn_ranks  # (no torch: the ranks import it)

        pg, first = self._launch_options["placement_group"], self._launch_options["first_rank_bundle"]
        tp = self._config.parallel.world_size
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
            self._dead = "the engine gave up on its workers"  # (clients read it: error's text is logged)
            logger.error("%s: %s: %s", self.engine_name, self._dead, error)

    async def _restart_engine(self, dead) -> None:
        self.num_engine_restarts += 1
        started = time.monotonic()
        try:
            ray.kill(dead, no_restart=True)
            self._kill_ranks()
            self.engine = await asyncio.wait_for(self._start_engine(), timeout=ENGINE_START_TIMEOUT_S)
            logger.warning("%s serves again after %.1fs", self.engine_name, time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - reported by the health check, which makes Serve replace us
            self._dead = "the engine could not be restarted"
            logger.error("%s: %s", self.engine_name, self._dead, exc_info=exc)
        finally:
            self._restarting = None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, subscriber: str = ""):
        """Admit the request into this replica's engine and yield the engine's actor name: the outputs
        flow from that actor to ``subscriber`` on its multiplexed stream. The call stays open until the
        request ends, so Serve counts it as ongoing here; cancelled first, it aborts the request."""
        engine = self._live_engine()
        admission = asyncio.ensure_future(
            engine.add_request.remote(request_id, prompt_token_ids, params, cache_salt, subscriber))
        try:
            await asyncio.shield(admission)
        except asyncio.CancelledError:
            # the caller left while the engine admitted the request: abort it once the engine knows
            # its id (an abort sent now could reach the engine first and miss it)
            self._abort_after_admission(engine, admission, request_id)
            raise
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

    def _abort_after_admission(self, engine, admission, request_id: str) -> None:
        async def abort() -> None:
            try:
                await admission
            except Exception:  # noqa: BLE001 - refused or the engine died: nothing runs to abort
                return
            engine.abort.remote(request_id)

        task = asyncio.get_running_loop().create_task(abort(), context=contextvars.Context())
        self._aborting.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._aborting.discard)

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
