"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.messages import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import CompileQueueFullError

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}


def model_config(model: str | None, *, revision: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None) -> ModelConfig:
    """``ModelConfig`` for what users write as ``model=``: nothing (the default checkpoint), a directory or
    a Hugging Face repo id. Resolving it is the workers' business (``workers.model_source``, loaded by name
    like the executors)."""
    path = importlib.import_module("workers.model_source").resolve_model(model, revision)
    source = None if model is None or Path(model).expanduser().is_dir() else str(model)
    return ModelConfig.from_dir(path, dtype=dtype, max_model_len=max_model_len, source=source,
                                revision=revision if source else None)


def engine_config(
    model: str | None = None,
    *,
    revision: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_layer_split: list[int] | tuple[int, ...] | None = None,
    batches_in_flight: int | None = None,
    dtype: str = "auto",
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    num_host_kv_blocks: int = 0,
    kv_offload_bytes: int | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    max_model_len: int | None = None,
    seed: int = 0,
    device: str = "auto",
    placement_strategy: str = "STRICT_PACK",
    tp_dispatch: str = "remote",
    enable_expert_parallel: bool = False,
    attention_backend: str = "auto",
    cascade_attention: bool = True,
    deterministic: bool = False,
    cpu_matmul_precision: str = "highest",
    enforce_eager: bool = True,
    max_worker_restarts: int = 3,
    worker_restart_window_s: float = 600.0,
    worker_restart_backoff_s: float = 1.0,
    max_consecutive_failed_steps: int = 3,
    max_n: int = 128,
    max_logprobs: int = 20,
    max_stop_sequences: int = 64,
    max_stop_string_length: int = 1024,
    max_stop_total_length: int = 16384,
    max_stop_token_ids: int = 1024,
    max_prompt_logprobs_entries: int = 100_000,
    structured_output_max_length: int = 65536,
    structured_output_max_depth: int = 64,
    structured_output_max_count: int = 4096,
    structured_output_compile_timeout_s: float = 10.0,
    structured_output_max_pending_compiles: int = 64,
    structured_output_compile_threads: int = 2,
) -> EngineConfig:
    """An ``EngineConfig`` from the flat keyword arguments users know from vLLM."""
    return EngineConfig(
        model=model_config(model, revision=revision, dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(block_size, enable_prefix_caching, num_kv_blocks, kv_cache_memory_bytes,
                          gpu_memory_utilization, num_host_kv_blocks, kv_offload_bytes,
                          disable_hybrid_kv_cache_manager, kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
        parallel=ParallelConfig(tensor_parallel_size, placement_strategy, tp_dispatch, enable_expert_parallel,
                                pipeline_parallel_size,
                                None if pipeline_layer_split is None else tuple(pipeline_layer_split),
                                batches_in_flight),
        device=device,
        seed=seed,
        attention_backend=attention_backend,
        cascade_attention=cascade_attention,
        deterministic=deterministic,
        cpu_matmul_precision=cpu_matmul_precision,
        enforce_eager=enforce_eager,
        max_worker_restarts=max_worker_restarts,
        worker_restart_window_s=worker_restart_window_s,
        worker_restart_backoff_s=worker_restart_backoff_s,
        max_consecutive_failed_steps=max_consecutive_failed_steps,
        max_n=max_n,
        max_logprobs=max_logprobs,
        max_stop_sequences=max_stop_sequences,
        max_stop_string_length=max_stop_string_length,
        max_stop_total_length=max_stop_total_length,
        max_stop_token_ids=max_stop_token_ids,
        max_prompt_logprobs_entries=max_prompt_logprobs_entries,
        structured_output_max_length=structured_output_max_length,
        structured_output_max_depth=structured_output_max_depth,
        structured_output_max_count=structured_output_max_count,
        structured_output_compile_timeout_s=structured_output_compile_timeout_s,
        structured_output_max_pending_compiles=structured_output_max_pending_compiles,
        structured_output_compile_threads=structured_output_compile_threads,
    )


class LLM:
    """Batch generation with a paged KV cache, prefix caching and continuous batching.

    >>> llm = LLM(model="/path/to/model")  # or a Hugging Face repo id: "org/name"
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = engine_config(model, **kwargs)
        self.core = EngineCore(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        Every prompt is validated before any is added, so a bad one raises ValueError and leaves the
        engine untouched. A request the engine fails (a step that ran it alone raised) comes back
        finished with ``error`` set and finish reason "error"; the others are unaffected.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        processed = [self.core.process_inputs(self._prompt_input(p)) for p in prompts]
        for p, (_, token_ids) in zip(params, processed):
            self.core.check_sampling_params(p, len(token_ids))
        grammars = self._compile_all(params)
        request_ids = [str(next(self._ids)) for _ in prompts]
        for request_id, (text, token_ids), p, grammar in zip(request_ids, processed, params, grammars):
            self.core.add_processed_request(request_id, text, token_ids, p, cache_salt=cache_salt, grammar=grammar)
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(request_ids):
                for output in self.core.step():
                    if output.finished:
                        finals[output.request_id] = output
        except BaseException:
            for request_id in request_ids:
                if request_id not in finals:
                    self.core.abort_request(request_id)
            raise
        return [finals[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the model's chat template (as transformers
        renders it), with ``tools`` and ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``)
        passed to the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.core.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode(
            tokenizer.apply_chat_template(c, tools=tools, chat_template_kwargs=chat_template_kwargs),
            add_special_tokens=False)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def _compile_all(self, params: list[SamplingParams]) -> list:
        """The grammars of ``params`` (None where unconstrained). They compile together (a thread
        pool; the cache shares repeats) up to ``structured_output_max_pending_compiles`` at a time:
        when the bound is reached, those started are waited for before more start, so any number of
        distinct constraints fits it. Each waits at most ``structured_output_compile_timeout_s`` from
        its compile's start. Any that does not compile raises ValueError here, before anything is added."""
        manager = self.core.structured_outputs
        grammars: list = [None] * len(params)
        started: list[tuple[int, object]] = []
        try:
            for i, p in enumerate(params):
                if not p.structured_outputs:
                    continue
                deadline = None
                while True:
                    try:
                        started.append((i, manager.compile_async(p.structured_outputs)))
                        break
                    except CompileQueueFullError:
                        if started:  # wait for ours, then go on
                            self._wait_all(started, grammars)
                            continue
                        # full of compiles that outlived their callers (timed out): wait for a place
                        deadline = deadline or time.monotonic() + (manager.compile_timeout_s or 0)
                        if time.monotonic() >= deadline:
                            raise
                        time.sleep(0.01)
            self._wait_all(started, grammars)
        finally:
            for _, future in started:
                manager.release(future)
        return grammars

    def _wait_all(self, started: list, grammars: list) -> None:
        manager = self.core.structured_outputs
        while started:
            i, future = started[0]
            grammars[i] = manager.result(future)
            started.pop(0)
            manager.release(future)

    @staticmethod
    def _prompt_input(prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def stats(self) -> dict:
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
