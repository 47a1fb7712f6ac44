"""EngineCore: scheduler + executor + output processing, one synchronous step at a time.

The offline ``LLM`` drives it directly; ``AsyncLLM`` (and the scheduler actor) drive it from a step
loop. Every request is validated before it reaches the scheduler, so a bad request raises to its
caller and never disturbs the step loop.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

from engine.config import EngineConfig
from engine.executor import Executor, WorkerFailedError, create_executor
from engine.messages import RequestOutput
from engine.metrics import StepTimings
from engine.output_processor import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.pipelined_steps import PipelinedSteps
from engine.step_failures import EngineDeadError, RequestFailedError, StepFailures  # noqa: F401 - re-exported
from engine.structured_output import StructuredOutputManager
from engine.tokenizer import Tokenizer
from engine.window_kv import check_pool_fits

logger = logging.getLogger(__name__)

PromptType = str | list[int]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at its bound; the request was not admitted (HTTP 503)."""


class EngineCore(PipelinedSteps, StepFailures):
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model.path)
        self.executor = executor or create_executor(config)
        try:
            num_blocks = config.cache.num_kv_blocks or self.executor.determine_num_kv_blocks()
            check_pool_fits(num_blocks, config.cache.block_size, config.max_model_len, config.kv_layout(),
                            config.scheduler.max_num_batched_tokens)  # window pages too, if hybrid
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_kv_blocks = num_blocks
        kv_info = self.executor.kv_cache_info()  # the host tier's size is the ranks' (bytes -> blocks)
        # constrained decoding: grammars compiled off the step loop, matchers and bitmasks beside the scheduler
        self.structured_outputs = StructuredOutputManager.from_config(self.tokenizer, config)
        self.scheduler = Scheduler(
            structured_outputs=self.structured_outputs,
            num_host_kv_blocks=kv_info.get("num_host_kv_blocks", 0),
            host_kv_block_bytes=kv_info.get("kv_bytes_per_block_all_ranks",
                                            kv_info.get("kv_bytes_per_block_per_rank", 0)),
            num_kv_blocks=num_blocks,
            block_size=config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            kv_layout=config.kv_layout(),
        )
        logger.info("KV layout: %s", self.scheduler.kv.layout.describe())
        self.outputs = OutputProcessor(self.tokenizer)
        self.timings = StepTimings()
        self._eos_token_ids = frozenset(config.model.eos_token_ids)
        self.num_worker_restarts = 0
        self._restart_times: deque[float] = deque()  # monotonic times of the rebuilds in the window
        self._dead: EngineDeadError | None = None  # set once the ranks are given up on
        self.num_failed_steps = 0  # steps that raised (not counting lost ranks)
        self.num_failed_requests = 0  # requests failed because a step that held them alone raised
        # requests of a step that raised, to be run one per step until the one that fails alone is found
        self._suspects: deque[str] = deque()
        # steps of one request that raised since the last step that ran, and their samples: many in a
        # row with different requests means broken ranks, not a poisonous request (``_ranks_look_broken``)
        self._failed_in_a_row = 0
        self._failed_in_a_row_samples: set[str] = set()
        self._plan_retried = False  # the last plan raised and is being planned again whole (``_plan_failed``)
        self._probe_id: str | None = None  # the request run alone to tell broken ranks from bad requests
        self._init_in_flight()  # steps in flight under pipeline parallelism (engine.pipelined_steps)
        # held while the step changes the scheduler, the block pool or the outputs (never while the
        # ranks compute), so that other threads (stats, the router's hash report) read them whole
        self.lock = threading.RLock()
        # what start-up made (model, tokenizer, the pool's bookkeeping) lives as long as the engine:
        # out of the collector's sight, the collections that steps trigger stay short (a frozen cycle is
        # never freed: none holds the model, see ``workers.weight_loader.WeakLoader``)
        gc.collect()
        gc.freeze()

    # --- requests ------------------------------------------------------------------------------

    def process_inputs(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Tokenize and validate a prompt: (prompt text or None, token ids). Raises ValueError."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_len}")
        vocab_size = self.config.model.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        return text, token_ids

    def check_sampling_params(self, params: SamplingParams, num_prompt_tokens: int | None = None) -> None:
        """Raise ValueError for what SamplingParams cannot check alone: the engine's caps on what one
        request may ask for (``max_n``, ``max_logprobs``, ``max_stop_sequences``,
        ``max_stop_token_ids``; with the prompt's (truncated) length, ``max_prompt_logprobs_entries``,
        times ``n``) and token ids outside the vocab (a stop token id past the vocab
        would crash the sampler's min_tokens mask mid-step)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        cfg = self.config
        vocab_size = cfg.model.vocab_size
        if params.n > cfg.max_n:
            raise ValueError(f"n must be at most {cfg.max_n} (the engine's max_n), got {params.n}")
        max_logprobs = min(cfg.max_logprobs, vocab_size)
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"logprobs must be at most {max_logprobs} (the engine's max_logprobs), "
                             f"got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs must be at most {max_logprobs} (the engine's max_logprobs), "
                             f"got {params.prompt_logprobs}")
        if params.prompt_logprobs is not None and num_prompt_tokens is not None:
            # times n: computed once, but a completion response repeats them in each of its n choices
            entries = num_prompt_tokens * (params.prompt_logprobs + 1) * params.n
            if entries > cfg.max_prompt_logprobs_entries:
                times_n = f" x n={params.n}" if params.n > 1 else ""
                raise ValueError(f"prompt_logprobs may return at most {cfg.max_prompt_logprobs_entries} entries (the "
                                 f"engine's max_prompt_logprobs_entries), got {num_prompt_tokens} prompt tokens x "
                                 f"{params.prompt_logprobs + 1}{times_n} = {entries}")
        if len(params.stop) > cfg.max_stop_sequences:
            raise ValueError(f"at most {cfg.max_stop_sequences} stop strings are allowed (the engine's "
                             f"max_stop_sequences), got {len(params.stop)}")
        longest = max((len(s) for s in params.stop), default=0)
        if longest > cfg.max_stop_string_length:
            raise ValueError(f"a stop string may hold at most {cfg.max_stop_string_length} characters (the engine's "
                             f"max_stop_string_length), got {longest}")
        if sum(len(s) for s in params.stop) > cfg.max_stop_total_length:
            raise ValueError(f"the stop strings may hold at most {cfg.max_stop_total_length} characters in all (the "
                             f"engine's max_stop_total_length), got {sum(len(s) for s in params.stop)}")
        if len(params.stop_token_ids) > cfg.max_stop_token_ids:
            raise ValueError(f"at most {cfg.max_stop_token_ids} stop_token_ids are allowed (the engine's "
                             f"max_stop_token_ids), got {len(params.stop_token_ids)}")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        text, token_ids = self.process_inputs(prompt)
        self.add_processed_request(request_id, text, token_ids, params or SamplingParams(),
                                   cache_salt=cache_salt, arrival_time=arrival_time)

    def add_processed_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        grammar=None,
    ) -> None:
        """Add a request whose prompt went through ``process_inputs``. ``n`` > 1 becomes n sibling
        requests that share the prompt's blocks once the first has computed them. A constrained
        request's grammar is compiled first (outside the lock; ``grammar``: already compiled, by
        ``structured_outputs.compile_async``); one that does not compile raises ValueError."""
        if isinstance(params, SamplingParams) and params.structured_outputs is not None and grammar is None:
            self.check_sampling_params(params, len(prompt_token_ids))
            grammar = self.structured_outputs.compile(params.structured_outputs)
        with self.lock:
            self._add_processed_request(request_id, prompt, prompt_token_ids, params, cache_salt, arrival_time,
                                        grammar)

    def _add_processed_request(self, request_id, prompt, prompt_token_ids, params, cache_salt,
                               arrival_time, grammar=None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"a request id must be a non-empty string, got {request_id!r}")
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_sampling_params(params, len(prompt_token_ids))
        # the samples' own ids: "<request id>#<index>" for every n (n = 1 too), so they never collide
        # across requests: the text after the last "#" is the index, the rest the request id
        sample_ids = [f"{request_id}#{i}" for i in range(params.n)]
        if any(s in self.scheduler.requests for s in sample_ids):  # cannot happen; checked before any change
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = time.time() if arrival_time is None else arrival_time
        max_len = self.config.max_model_len
        max_tokens = max(1, min(params.max_tokens or max_len, max_len - len(prompt_token_ids)))
        self.outputs.add_request(request_id, prompt, prompt_token_ids, params, sample_ids, arrival_time)
        first: Request | None = None
        for i, sample_id in enumerate(sample_ids):
            request = Request(
                sample_id, prompt_token_ids, params if params.n == 1 else params.for_child(i),
                eos_token_ids=self._eos_token_ids, block_size=self.config.cache.block_size,
                max_tokens=max_tokens, cache_salt=cache_salt, arrival_time=arrival_time,
                fork_source=first, long_rope_from=self.config.model.long_rope_threshold,
            )
            first = first or request
            if params.structured_outputs is not None:
                request.grammar = self.structured_outputs.new_matcher(grammar)
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output, or None if unknown."""
        with self.lock:
            self.scheduler.finish_requests(self.outputs.sample_ids_of(request_id), RequestStatus.FINISHED_ABORTED)
            return self.outputs.abort(request_id)

    def discard_request(self, request_id: str) -> None:
        """Remove whatever the engine holds of a request whose add or abort raised midway (its
        samples and their blocks, its output state), whatever state that left."""
        with self.lock:
            prefix = request_id + "#"
            samples = [s for s in self.scheduler.requests if s.startswith(prefix) and s[len(prefix):].isdigit()]
            self.scheduler.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
            if self.outputs.requests.get(request_id) is not None:
                self.outputs._end(request_id, "abort")
                self.outputs.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine cannot run steps any more, or None while it can."""
        return self._dead

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan and run one step; returns the outputs it produced.

        A step that raises (an exception inside a rank, not a lost rank) is rolled back whole and
        its requests run again one per step: the one that fails alone fails with RequestFailedError
        (its output carries ``error``), the others produce exactly the tokens they would have.
        A lost rank rebuilds the ranks and recomputes every running request; an interruption
        (KeyboardInterrupt) rolls the step back and raises. With steps in flight (pipeline stages),
        a call sends one and answers the oldest's outputs (``engine.pipelined_steps``)."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._pipelining():
            return self._step_in_flight()
        if self._in_flight:  # back to one step at a time: the steps out first
            return self._collect_oldest()
        start = time.perf_counter()
        with self.lock:
            only = self._next_suspect()
            try:
                scheduler_output = self.scheduler.schedule(only=only)
            except Exception as exc:  # noqa: BLE001 - the plan was undone (an interruption too, which goes on)
                return self._plan_failed(only, exc)
            self._plan_retried = False
            if scheduler_output.is_empty:
                if only is not None:
                    self._suspects.popleft()  # it cannot run now: nothing held it alone, so it is cleared
                return []
        execute_start = time.perf_counter()
        try:
            runner_output = self.executor.execute_model(scheduler_output)
        except WorkerFailedError as exc:
            self._recover(exc)
            return []
        except BaseException as exc:
            outputs: list[RequestOutput] = []
            with self.lock:
                # nothing of the step is kept: not its tokens, not the prefix-cache entries it planned
                self.scheduler.rollback(scheduler_output)
                if not isinstance(exc, Exception):
                    raise
                broken = self._ranks_look_broken(scheduler_output, exc)  # None: a probe runs next
                if broken is False:
                    outputs = self._isolate(scheduler_output, exc)
            if broken:
                self._recover(WorkerFailedError(f"{self._failed_in_a_row} steps failed in a row with different requests"))
            elif getattr(exc, "ranks_stuck", False):
                self._restart_ranks(exc)
            return outputs
        execute_wall = time.perf_counter() - execute_start
        request_outputs = self._step_ran(scheduler_output, runner_output, ran_alone=only is not None)
        self.timings.record(time.perf_counter() - start, runner_output.forward_time_s,
                            runner_output.execute_time_s, execute_wall - runner_output.execute_time_s)
        return request_outputs

    def _take_outputs(self, scheduler_output, runner_output, request_outputs: list[RequestOutput]) -> None:
        """The step ran: append its tokens, make the outputs (into ``request_outputs``), end the
        requests that stopped or failed alone (a rejected token, an update or an output that raised)."""
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        made, stopped = self.outputs.process(core_outputs)
        request_outputs.extend(made)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        failures = [(s, "its grammar rejected a sampled token") for s in self.scheduler.take_grammar_failures()]
        failures += self.scheduler.take_update_failures()
        for sample_id, kind in failures:
            request_id = self.outputs.request_id_of(sample_id)
            if request_id is None:
                self.scheduler.finish_requests([sample_id], RequestStatus.FINISHED_ERROR)
                continue
            output = self._fail_request(request_id, kind)
            if output is not None:
                request_outputs.append(output)
        for request_id, kind in self.outputs.take_failed().items():
            output = self._fail_request(request_id, kind)
            if output is not None:
                request_outputs.append(output)

    # --- introspection ------------------------------------------------------------------------------

    def cached_prefix_hashes(self, limit: int = 16384) -> bytes:
        """The prefix cache's block hashes, most recently used first (a hit refreshes a block), 8
        bytes each, concatenated: a consistent snapshot, safe to take from any thread."""
        with self.lock:  # a copy of ``limit`` hashes (engine/prefix_report.py): never a pass over the pool
            hashes = self.scheduler.kv.block_pool.hashes_by_recency(limit)
        return b"".join(h[:8] for h in hashes)

    def stats(self) -> dict:
        with self.lock:
            return self._stats()

    def _stats(self) -> dict:
        sched = self.scheduler
        pool = sched.kv.block_pool
        s = sched.stats
        return {
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "num_preemptions": s.num_preemptions,
            "num_blocks_in_use": pool.num_used_blocks,
            "num_kv_blocks": pool.num_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_blocks_made": pool.num_blocks_made,  # the pool's first fill (bounded by num_kv_blocks)
            "kv_cache_usage": pool.usage,
            "kv_cache_waste": self._waste_now(),
            "kv_cache_usage_peak": s.kv_peak_blocks / pool.num_usable_blocks,
            "kv_waste_at_peak": s.kv_waste_at_peak,
            "block_size": self.config.cache.block_size,
            "kv_window_groups": sched.kv.num_window_groups,  # hybrid KV layout (0: plain)
            "kv_window_pages_held": pool.num_held_pages,
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_generation_tokens": s.num_generation_tokens,
            "num_steps": self.timings.num_steps,
            "step_time_s": self.timings.step_time_s,
            "forward_time_s": self.timings.forward_time_s,
            "dispatch_time_s": self.timings.dispatch_time_s,
            "engine_overhead_fraction": self.timings.overhead_fraction,
            "num_worker_restarts": self.num_worker_restarts,
            "num_failed_steps": self.num_failed_steps,
            "num_failed_requests": self.num_failed_requests,
            "finished_requests": dict(self.outputs.finished.finished),
            "histograms": {
                "time_to_first_token_seconds": self.outputs.latency.time_to_first_token.as_dict(),
                "inter_token_latency_seconds": self.outputs.latency.inter_token_latency.as_dict(),
                "e2e_request_latency_seconds": self.outputs.latency.e2e_latency.as_dict(),
                "request_queue_time_seconds": s.queue_time.as_dict(),
                "request_prompt_tokens": self.outputs.finished.prompt_tokens.as_dict(),
                "request_generation_tokens": self.outputs.finished.generation_tokens.as_dict(),
            },
            **self.executor.kv_cache_info(),
            **sched.kv.host_tier_stats(),
        }

    def _waste_now(self) -> float:
        used, empty = self.scheduler.kv_occupancy()
        return empty / (used * self.config.cache.block_size) if used else 0.0

    def reset_prefix_cache(self) -> bool:
        with self.lock:
            return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()
