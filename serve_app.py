"""The Ray Serve application: `serve run serve_app:app model=DIR tensor_parallel_size=N ...`.

    client ──HTTP/SSE──► Ingress (FastAPI: api/http_app.py + api/openai_serving.py)
           ──gRPC──────► Ingress.Generate / GenerateStream (api/grpc_serving.py)
           ──handle────► Ingress.generate / generate_stream
                            │  DeploymentHandle, prefix-aware router (cluster/router.py)
                            ▼
                       LLMServer replica ── owns ──► SchedulerActor (+ worker actors when tp > 1)
                       (cluster/llm_server.py)        all in the replica's placement group

Each LLMServer replica reserves one placement group: its own bundle, the engine's bundle (the
scheduler actor, which also holds the model at tp = 1), and one bundle per rank at tp > 1; Serve
scales replicas with these resources accounted. The reservations are sized for the cluster the app
will run on (`plan_reservations`, cluster/reservations.py): where the CPUs are too few for the replica, the scheduler actor
and the Ingress to have bundles of their own, they take none and share the engine's or rank 0's,
and a request that cannot fit at all stops the build with the setting to change.

Failures: a replica rebuilds a scheduler actor that died in place (``max_engine_restarts``), after
which its health check fails and Serve replaces it. While no engine can take a request (restarting,
replaced, not placed) the Ingress answers 503 ``engine_unavailable`` with Retry-After (gRPC
UNAVAILABLE), and /health and /v1/models answer 503, rather than leaving requests waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from pathlib import Path

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from api import grpc_serving
from api.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES
from api.errors import OpenAIError
from api.http_app import build_openai_app, validation_error
from api.metrics import prometheus_text
from api.openai_chat_protocol import ChatCompletionRequest
from api.openai_protocol import CompletionRequest
from api.openai_serving import OpenAIServing
from cluster.app_args import ENGINE_KWARGS, AppArgs, _with_options, api_key_from_env, api_key_from_file
from cluster.engine_gate import EngineGate, EngineWatch
from cluster.ingress_client import ServeEngineClient, new_engine_id  # noqa: F401 - the Ingress's engine client
from cluster.llm_server import HEALTH_CHECK_PERIOD_S, HEALTH_CHECK_TIMEOUT_S, ROUTING_STATS_PERIOD_S, LLMServer
from cluster.memory_plan import bundle_memory, memory_refusal, replicas_refusal
from cluster.reservations import cluster_cpus, cluster_memory, plan_reservations
from cluster.serve_env import SERVE_ENV, effective_serve_env  # noqa: F401 - SERVE_ENV: what serve_env() sets
from engine import SamplingParams, engine_config
from engine.config import ModelConfig
from engine.messages import RequestOutput, merge_outputs
from engine.sampling_params import MAX_LOGPROBS, RequestOutputKind
from engine.tokenizer import Tokenizer
from workers.model_source import localize_model

logger = logging.getLogger("ray.serve")


class Ingress:
    """HTTP (OpenAI API), gRPC and Python-handle entry point of the application."""

    def __init__(self, llm_server: DeploymentHandle, model: ModelConfig, served_model_name: str,
                 max_model_len: int, api_key: str | None, stream_interval: int = 1, min_engines: int = 1,
                 api_key_env: str | None = None, api_key_file: str | None = None,
                 tool_call_parser: str = "generic", max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, max_logprobs: int = MAX_LOGPROBS,
                 llm_server_limits: tuple[int, int] | None = None) -> None:
        self.tokenizer = Tokenizer(localize_model(model).path)  # the checkpoint's copy on this node
        self.app_name = serve.get_replica_context().app_name
        self.engines = EngineWatch(self.app_name, min_engines)
        self.client = ServeEngineClient(llm_server, self.engines, llm_server_limits)
        self.serving = OpenAIServing(self.client, self.tokenizer, served_model_name, max_model_len, stream_interval,
                                     tool_call_parser=tool_call_parser, max_prompts_per_request=max_prompts_per_request,
                                     max_logprobs=max_logprobs)
        self.max_request_body_bytes = max_request_body_bytes
        self.served_model_name = served_model_name
        self.api_key = api_key_from_env(api_key_env) if api_key_env is not None else \
            api_key_from_file(api_key_file) if api_key_file is not None else api_key

    def __serve_build_asgi_app__(self):
        app = build_openai_app(lambda: self.serving, api_key=self.api_key, metrics_text=self.metrics_text,
                               kv_map=self.kv_map, max_body_bytes=self.max_request_body_bytes)
        app.add_middleware(EngineGate, available=self.engines.available, api_key=self.api_key, full=self.client.full)
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
        actors = await self.engines.actors()  # Ray's lookups on a thread, kept a second: never on this loop

        async def ask(actor):
            try:
                return await asyncio.wait_for(getattr(actor, method).remote(), timeout=5)
            except Exception:  # noqa: BLE001 - a replica going away between list and call
                return None

        results = await asyncio.gather(*(ask(a) for a in actors.values()))
        return {n.removeprefix(prefix): r for n, r in zip(actors, results) if r is not None}

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


# where a GPU driver shows itself (NVIDIA, ROCm, WSL2): without any, device=auto needs no torch to say CPU
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def _use_gpu(device: str, accelerator_type: str | None = None) -> bool:
    """Whether the engines run on GPUs. ``device=auto`` means CUDA when an accelerator_type is given,
    when the Ray cluster has GPUs now, or (Ray not started yet) when this machine has one. A cluster
    whose GPU workers are scaled to zero when the app is built has none now: give device=cuda or an
    accelerator_type there."""
    if device != "auto" or accelerator_type is not None:
        return device == "cuda" or accelerator_type is not None
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS) and os.path.isdir("/dev"):
        return False  # no GPU driver on this machine (Linux): no need to import torch (seconds) to know it
    import torch

    return torch.cuda.is_available()


def serve_env() -> dict[str, str]:
    """Serve's settings for the serving path (``cluster/serve_env.py``) as this environment has them.
    Before Ray starts here (`serve run` starts its local cluster after building the app) they are set
    in this process, which the cluster's processes (Serve's proxy among them) inherit; the deployments
    carry them in their runtime_env."""
    return effective_serve_env(set_here=not ray.is_initialized())


def build_app(args: AppArgs | dict | None = None):
    """The application for `serve run serve_app:app key=value ...` (and `serve deploy`)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    env_vars = serve_env()  # both deployments' (and, before Ray starts, this process's)
    # every engine setting is a flat app argument of the same name (ENGINE_KWARGS)
    config = engine_config(args.model, revision=args.revision, **{key: getattr(args, key) for key in ENGINE_KWARGS})
    use_gpu = _use_gpu(args.device, args.accelerator_type)
    # GPU engines on a cluster with no GPU node yet (its GPU workers scaled to zero): the autoscaler
    # adds the nodes they need, so the nodes alive now say nothing about where they will fit
    gpus_now = ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else None
    nodes_known = not (use_gpu and gpus_now == 0)
    # each rank's bundle reserves the host memory it holds, so that Ray puts a stage only on a node that
    # can hold it; a rank no node can hold is refused here, with what it needs
    memory = cluster_memory() if nodes_known else None
    refusal = memory_refusal(config, use_gpu, memory) or replicas_refusal(config, use_gpu, memory, args.replica_range[1])
    if refusal is not None:
        raise ValueError(refusal)
    plan = plan_reservations(args, use_gpu, cluster_cpus() if nodes_known else None,
                             rank_memory=bundle_memory(config, use_gpu, memory))
    # a repo id is served under its own name (as the hub spells it); a directory under its last component
    served_name = args.served_model_name or config.model.source or Path(config.model.path).name
    options: dict = {
        "name": "LLMServer",
        "ray_actor_options": {"num_cpus": plan.replica_cpus, "runtime_env": {"env_vars": env_vars}},
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
            # the window the autoscaler averages load over: keep it above Serve's metrics push interval
            # (10 s by default, RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S)
            "look_back_period_s": args.look_back_period_s,
        }
        push = os.environ.get("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S")
        if push and args.look_back_period_s <= 10.0:  # Serve checks the window against this (deprecated) field
            options["autoscaling_config"]["metrics_interval_s"] = float(push)
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
        {"name": "Ingress", "ray_actor_options": {"num_cpus": plan.ingress_cpus, "runtime_env": {"env_vars": env_vars}},
         "max_ongoing_requests": 10_000},
        args.ingress_deployment_config))
    min_engines = args.replica_range[0] if args.autoscaling or "num_replicas" in args.deployment_config \
        else (args.num_replicas or 1)
    if args.api_key_env is not None:
        api_key_from_env(args.api_key_env)  # set where the app is built too: a missing key stops the build
    if args.api_key_file is not None:
        api_key_from_file(args.api_key_file)
    return ingress.bind(llm_server, config.model, served_name, config.max_model_len, args.api_key,
                        args.stream_interval, min_engines, args.api_key_env, args.api_key_file,
                        args.tool_call_parser, args.max_prompts_per_request, args.max_request_body_bytes,
                        config.max_logprobs,
                        llm_server_limits=(options["max_ongoing_requests"], options["max_queued_requests"]))


app = build_app
