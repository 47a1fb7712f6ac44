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
scales replicas with these resources accounted.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from typing import Literal

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from api import grpc_serving
from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from cluster.scheduler_actor import launch_scheduler_actor
from engine import EngineDeadError, EngineOverloadedError, SamplingParams, engine_config
from engine.config import EngineConfig
from engine.metrics import prometheus_text
from engine.messages import RequestOutput, merge_outputs
from engine.sampling_params import RequestOutputKind
from engine.tokenizer import Tokenizer

ENGINE_NAMESPACE = "kvserve"
ROUTING_STATS_PERIOD_S = 1.0


class AppArgs(BaseModel):
    """Arguments of `serve run serve_app:app key=value ...` (validated; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None  # a model directory; default: the llama `small` preset, built if missing
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    attention_backend: Literal["auto", "torch", "cpu"] = "auto"
    cascade_attention: bool = True
    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 120.0
    router: Literal["prefix", "pow2"] = "prefix"
    router_imbalance: int = 8  # queue-length gap beyond which the router prefers the least loaded replica
    api_key: str | None = None
    max_waiting_requests: int = 512
    stream_interval: int = Field(1, ge=1)  # streamed tokens per chunk (fewer, larger SSE chunks when > 1)
    engine_cpus: float = 1.0  # logical CPUs of the engine bundle (tp = 1) or of each rank
    torch_threads: int | None = None  # intra-op threads of the engine at tp = 1 (default: engine_cpus)
    proxy_cpus: float = 0.5  # logical CPUs of each Ingress and LLMServer replica

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @model_validator(mode="after")
    def _replicas(self) -> AppArgs:
        if self.autoscaling and self.num_replicas is not None:
            raise ValueError("give num_replicas, or min_replicas/max_replicas for autoscaling, not both")
        low, high = self.replica_range
        if self.autoscaling and not 0 <= low <= high:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {low} and {high}")
        return self

    @property
    def replica_range(self) -> tuple[int, int]:
        low = self.min_replicas if self.min_replicas is not None else 1
        return low, self.max_replicas if self.max_replicas is not None else max(1, low)


class LLMServer:
    """One engine instance: starts its scheduler actor (and ranks) in this replica's placement group."""

    async def __init__(self, config: EngineConfig, args: AppArgs, use_gpu: bool) -> None:
        ctx = serve.get_replica_context()
        tp = config.parallel.tensor_parallel_size
        self.engine_name = f"engine:{ctx.app_name}:{ctx.replica_tag}"
        self.engine = launch_scheduler_actor(
            config,
            placement_group=ray.util.get_current_placement_group(), bundle_index=1,
            num_cpus=args.engine_cpus if tp == 1 else args.proxy_cpus,
            num_gpus=1 if use_gpu and tp == 1 else 0,
            name=self.engine_name, namespace=ENGINE_NAMESPACE,
            max_waiting_requests=args.max_waiting_requests,
            torch_threads=(args.torch_threads or max(1, int(args.engine_cpus))) if tp == 1 else None,
            wait=False,
        )
        await self.engine.ready.remote()
        self._routing_stats: dict = {}
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_routing_stats())

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, subscriber: str = ""):
        """Admit the request into this replica's engine and yield the engine's actor name: the outputs
        flow from that actor to ``subscriber`` on its multiplexed stream. The call stays open until the
        request ends, so Serve counts it as ongoing here; cancelled first, it aborts the request."""
        try:
            await self.engine.add_request.remote(request_id, prompt_token_ids, params, cache_salt, subscriber)
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        finished = False
        try:
            yield self.engine_name
            await self.engine.wait_finished.remote(request_id)
            finished = True
        finally:
            if not finished:
                self.engine.abort.remote(request_id)

    async def _refresh_routing_stats(self) -> None:
        while True:
            try:
                self._routing_stats = await self.engine.routing_stats.remote()
            except Exception:  # noqa: BLE001 - the health check reports a dead engine
                pass
            await asyncio.sleep(ROUTING_STATS_PERIOD_S)

    def record_routing_stats(self) -> dict:
        return self._routing_stats

    async def stats(self) -> dict:
        return await self.engine.stats.remote()

    async def placement(self) -> dict:
        """Placement group ids of this replica, its scheduler actor and its ranks."""
        return {"replica": ray.get_runtime_context().get_placement_group_id(),
                **await self.engine.placement.remote()}

    async def check_health(self) -> None:
        await asyncio.wait_for(self.engine.ready.remote(), timeout=30)


class ServeEngineClient:
    """The engine client of the OpenAI and gRPC layers in an Ingress replica.

    A request goes through the LLMServer handle (so Serve routes, counts and autoscales it); the
    replica answers with the name of its scheduler actor, and the deltas arrive on one multiplexed
    stream per scheduler actor, subscribed once per Ingress replica: one Ray object per engine step
    instead of one per token per request.
    """

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self.subscriber = f"ingress-{uuid.uuid4().hex}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._engine_of: dict[str, str] = {}
        self._subscriptions: dict[str, asyncio.Task] = {}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        call = self.handle.options(stream=True).generate.remote(
            request_id, prompt_token_ids, params, cache_salt=cache_salt, subscriber=self.subscriber)
        finished = False
        try:
            try:
                engine_name = await call.__anext__()
            except RayTaskError as exc:  # refused by the engine: nothing to cancel
                finished = True
                raise exc.as_instanceof_cause() from None
            except BackPressureError as exc:  # refused by Serve's router
                finished = True
                raise EngineOverloadedError(f"every replica is at its queue bound: {exc}") from None
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
            error = EngineDeadError(f"the engine {engine_name} stopped: {exc!r}")
            for request_id, name in list(self._engine_of.items()):
                if name == engine_name and request_id in self._queues:
                    self._queues[request_id].put_nowait(error)

    async def abort(self, request_id: str) -> None:
        engine_name = self._engine_of.get(request_id)
        if engine_name is not None:
            ray.get_actor(engine_name, namespace=ENGINE_NAMESPACE).abort.remote(request_id)


class Ingress:
    """HTTP (OpenAI API), gRPC and Python-handle entry point of the application."""

    def __init__(self, llm_server: DeploymentHandle, model_dir: str, served_model_name: str,
                 max_model_len: int, api_key: str | None, stream_interval: int = 1) -> None:
        self.tokenizer = Tokenizer(model_dir)
        self.client = ServeEngineClient(llm_server)
        self.serving = OpenAIServing(self.client, self.tokenizer, served_model_name, max_model_len, stream_interval)
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.app_name = serve.get_replica_context().app_name

    def __serve_build_asgi_app__(self):
        return build_openai_app(lambda: self.serving, api_key=self.api_key, metrics_text=self.metrics_text)

    async def metrics_text(self) -> str:
        """Prometheus text for every LLMServer replica of this application."""
        prefix = f"engine:{self.app_name}:"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == ENGINE_NAMESPACE and a["name"].startswith(prefix)]

        async def stats_of(name: str) -> dict | None:
            try:
                actor = ray.get_actor(name, namespace=ENGINE_NAMESPACE)
                return await asyncio.wait_for(actor.stats.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - a replica going away between list and call
                return None

        results = await asyncio.gather(*(stats_of(n) for n in names))
        by_replica = {n.removeprefix(prefix): s for n, s in zip(names, results) if s is not None}
        return prometheus_text(by_replica, self.served_model_name)

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

    # --- gRPC (Serve's gRPC proxy calls these by method name) --------------------------------------

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        return await grpc_serving.generate(request, self.client, self.tokenizer, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        async for response in grpc_serving.generate_stream(request, self.client, self.tokenizer, grpc_context):
            yield response


def _accumulate(total: RequestOutput, delta: RequestOutput) -> RequestOutput:
    return merge_outputs(total, delta, RequestOutputKind.DELTA)


def _use_gpu(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def replica_bundles(args: AppArgs, use_gpu: bool) -> list[dict[str, float]]:
    """[LLMServer replica] + [engine (model at tp = 1)] + [rank] * tp (tp > 1)."""
    gpu = {"GPU": 1.0} if use_gpu else {}
    proxy = {"CPU": args.proxy_cpus}
    if args.tensor_parallel_size == 1:
        return [proxy, {"CPU": args.engine_cpus, **gpu}]
    return [proxy, {"CPU": args.proxy_cpus}] + [{"CPU": args.engine_cpus, **gpu}] * args.tensor_parallel_size


def build_app(args: AppArgs | dict | None = None):
    """The application for `serve run serve_app:app key=value ...` (and `serve deploy`)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    if args.model is None:
        from workers.model_builder import default_model_dir

        args = args.model_copy(update={"model": str(default_model_dir())})
    config = engine_config(
        args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, seed=args.seed, device=args.device,
        placement_strategy=args.placement_strategy, attention_backend=args.attention_backend,
        cascade_attention=args.cascade_attention,
    )
    use_gpu = _use_gpu(args.device)
    served_name = args.served_model_name or args.model.rstrip("/").split("/")[-1]
    options: dict = {
        "name": "LLMServer",
        "ray_actor_options": {"num_cpus": args.proxy_cpus},
        "placement_group_bundles": replica_bundles(args, use_gpu),
        "placement_group_strategy": args.placement_strategy,
        # a replica takes what its engine can hold (running + waiting); each handle queues as many
        # more while no replica has room, and refuses the rest (BackPressureError -> 503)
        "max_ongoing_requests": args.max_num_seqs + args.max_waiting_requests,
        "max_queued_requests": args.max_num_seqs + args.max_waiting_requests,
        "health_check_period_s": 10,
    }
    if args.autoscaling:
        low, high = args.replica_range
        options["autoscaling_config"] = {
            "min_replicas": low, "max_replicas": high,
            "target_ongoing_requests": args.target_ongoing_requests,
            "upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s,
            "look_back_period_s": 5.0,
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
    llm_server = serve.deployment(LLMServer).options(**options).bind(config, args, use_gpu)
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress", ray_actor_options={"num_cpus": args.proxy_cpus}, max_ongoing_requests=10_000,
    )
    return ingress.bind(llm_server, args.model, served_name, config.max_model_len, args.api_key,
                        args.stream_interval)


app = build_app
