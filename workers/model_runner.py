"""One rank's step: apply the scheduler's diffs, build the flat batch (``workers.input_batch``,
with the step's shared-prefix groups), run the model shard, and (rank 0) sample.

The attention backend is chosen once, here, from ``attention_backend`` (one log line says which
runs) and travels with each step's metadata to every layer.

The model's shard for the rank's stage and its KV pool's per-layer view come from ``workers.stage_model``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from engine.messages import ModelRunnerOutput, SchedulerOutput, StageTiming
from engine.sampling_params import SamplingParams
from kernels import PagedAttentionMetadata, select_backend
from kernels.backends import deterministic_error
from kernels.kv_quant import is_quantized, kv_format
from workers.allocator import release_free_heap
from workers.cuda_graphs import DecodeGraphs, graph_batch_sizes
from workers.input_batch import InputBatch, RequestState
from workers.kv_pool import KVPoolSpec, allocate_kv_pool
from workers.layers.kernels import bind_cpu_kernels, bind_layer_ops
from workers.models.registry import kv_cache_shape
from workers.parallel_state import PipelineStage, TPGroup
from workers.prompt_logprobs import ROWS_PER_SLICE, compute_prompt_logprobs, plan_prompt_rows
from workers.sampler import GrammarMask, Sampler, SamplingRow
from workers.stage_model import bind_window_tables, build_stage_model, stage_layer_caches

logger = logging.getLogger(__name__)

WARM_UP_PREFILL_TOKENS = 256  # the warm-up's prefill, at most (``ModelRunner.warm_up``)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype,
                 stage: PipelineStage | None = None) -> None:
        self.config = config
        self.tp = tp
        num_layers = config.model.hf_config["num_hidden_layers"]
        # under pipeline parallelism this rank's stage of the layers; the last stage's first rank samples
        self.stage = stage or PipelineStage.whole(num_layers)
        self.samples = self.stage.is_last and tp.is_first_rank
        # this step's message from the previous stage is being read, its activations sent on (Worker.execute_model)
        self.received = self.handed_over = False
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        hf_config = config.model.hf_config
        self.model = build_stage_model(config, tp, dtype, device, self.stage)
        num_layers, kv_heads, head_dim, replicated = kv_cache_shape(hf_config, tp.size)
        # the whole model's layout (the scheduler's block and window tables), under pipeline parallelism too
        self.layout: KVLayout = config.kv_layout()
        if self.layout.num_layers != num_layers:
            raise ValueError(f"the KV layout has {self.layout.num_layers} layers, the model's KV {num_layers}")
        # the pool's tensor pairs: those this stage's layers use (every layer's for a plain layout of one
        # stage, page_layers for a hybrid one); a block of the pool holds their K/V
        self.pool_pairs = self.layout.pool_pairs(self.stage.start, self.stage.end)
        self.kv_format = kv_format(config.cache.kv_cache_dtype)
        self.kv_spec = KVPoolSpec(len(self.pool_pairs), kv_heads, head_dim, self.block_size, dtype, replicated,
                                  self.kv_format)
        self.kv_pool: list[tuple[torch.Tensor, torch.Tensor]] = []  # the pool's tensor pairs
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per stage layer (pairs repeat when hybrid)
        bind_window_tables(self.model, self.layout, self.stage)
        self.attention_backend, why = select_backend(config.attention_backend, device)
        self.matmul = "float32"  # the compiled CPU linear layers' products: "float32" or "bf16x3"
        if config.deterministic and (error := deterministic_error(self.attention_backend, dtype)):
            raise ValueError(error)
        if is_quantized(self.kv_format) and not getattr(self.attention_backend, "supports_quantized_kv", False):
            raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype!r} is not supported by the "
                             f"{self.attention_backend.name} attention backend")
        if self.attention_backend.layer_ops is not None:
            self.matmul = bind_cpu_kernels(self.model, self.attention_backend.layer_ops, config.deterministic,
                                           config.cpu_matmul_precision)
            release_free_heap()  # the weights' original layouts, freed
        elif getattr(self.attention_backend, "fused_ops", None) is not None:
            bind_layer_ops(self.model, self.attention_backend.fused_ops, config.deterministic)
        if tp.is_first_rank:
            logger.info(why + (f"; linear products {self.matmul}" if self.attention_backend.layer_ops else "")
                        + ("; deterministic: fixed-order linear and attention, no shared-prefix groups"
                               if config.deterministic else ""))
        sched = config.scheduler
        self.batch = InputBatch(self.block_size, config.max_model_len, device, self.attention_backend,
                                config.cascade_attention and not config.deterministic,
                                staging_size=3 * sched.max_num_batched_tokens + 2 * sched.max_num_seqs,
                                long_rope=getattr(self.model, "long_rope", None),
                                num_window_groups=self.layout.num_window_groups, kv_format=self.kv_format)
        argmax = getattr(self.attention_backend.layer_ops, "argmax", None)
        self.sampler = Sampler(device, config.seed, argmax) if self.samples else None
        self.eos_token_ids = tuple(config.model.eos_token_ids)
        self.graphs: DecodeGraphs | None = None  # decode-only steps through CUDA graphs (``capture_graphs``)
        if self.attention_backend.name == "triton":  # its split-KV scratch, allocated before the memory profile
            from kernels.triton.warmup import prepare_runner

            prepare_runner(self)

    def layer_caches(self, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The per-layer view (this stage's layers) of a pool's tensor pairs."""
        return stage_layer_caches(self.layout, self.stage, self.pool_pairs, pool)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_pool = allocate_kv_pool(self.kv_spec, num_blocks, self.device, prefault=True)
        self.kv_caches = self.layer_caches(self.kv_pool)
        if self.device.type == "cuda" and self.attention_backend.name == "triton":
            from kernels.triton.warmup import warm_up_runner

            warm_up_runner(self)  # every Triton kernel variant this configuration can launch, compiled now

    def graphs_unavailable(self) -> str | None:
        """Why decode steps cannot run through CUDA graphs here, or None."""
        if self.config.enforce_eager:
            return "enforce_eager=True"
        if self.layout.hybrid:  # the decode buffers hold the block table only, not the window groups' tables
            return "the hybrid KV layout's window tables are not in the decode graphs' buffers"
        if self.device.type != "cuda":
            return f"they need a CUDA device, not {self.device.type}"
        if self.stage.size > 1:
            return "pipeline parallelism runs every step eagerly"
        if not getattr(self.attention_backend, "supports_graphs", False):
            return (f"the {self.attention_backend.name} attention backend cannot be captured "
                    f"(attention_backend='triton' can)")
        return None

    def measure_graph_memory(self) -> int | None:
        """Before the KV pool is sized: capture the decode buckets over a one-block throwaway pool and
        release them, answering the device memory they took (``DecodeGraphs.memory_bytes``; 0 if the
        capture raised: then no real capture is tried and every step runs eagerly), or None where graphs
        will not be captured. The padding rows the capture runs read block 0 and write nothing."""
        if self.graphs_unavailable() is not None:
            return None
        kv_caches = self.layer_caches(allocate_kv_pool(self.kv_spec, 1, self.device))
        graphs = self._decode_graphs(kv_caches, graph_batch_sizes(self._max_decodes()), capture=True)
        try:
            graphs.capture()
            measured = graphs.memory_bytes
        except Exception as exc:  # noqa: BLE001 (the real capture fails too, or is held to 0 bytes)
            logger.warning("CUDA graph capture at start failed (%s)", f"{type(exc).__name__}: {exc}".splitlines()[0])
            measured = 0
        del graphs, kv_caches
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return measured

    def _decode_graphs(self, kv_caches, sizes: list[int], capture: bool) -> DecodeGraphs:
        """The decode buckets ``sizes`` over ``kv_caches``, planned for ``max_model_len`` contexts."""
        return DecodeGraphs(self.model, kv_caches, self.attention_backend, sizes,
                            -(-self.config.max_model_len // self.block_size), self.config.max_model_len,
                            self.config.deterministic, self.device, capture, self.kv_format)

    def capture_graphs(self, capture: bool | None = None, sizes: list[int] | None = None,
                       budget: int | None = None) -> bool:
        """Capture the decode buckets (after the KV pool exists). ``capture=False`` sets up the same
        buffers and plans and runs the model eagerly through them (tests on CPU); by default a graph
        is captured where ``graphs_unavailable`` says nothing. A failure is a warning: every step then
        runs eagerly. So are graphs that take more device memory than ``budget`` (what the KV budget
        left them, from ``measure_graph_memory``): they are released. Answers whether the buckets are
        in use."""
        if capture is None or self.layout.hybrid:  # hybrid: not even the eager set-up (graphs_unavailable)
            why = self.graphs_unavailable()
            if why is not None:
                if self.tp.is_first_rank and not self.config.enforce_eager:
                    logger.info("CUDA graphs off: %s; every step runs eagerly", why)
                return False
            capture = True
        sizes = sizes or graph_batch_sizes(self._max_decodes())
        graphs = self._decode_graphs(self.kv_caches, sizes, capture)
        # a budget of 0: the capture at start (measure_graph_memory) failed, and the pool left nothing
        error = "their capture at start failed" if budget == 0 else None
        if error is None:
            try:
                graphs.capture()
            except Exception as exc:  # noqa: BLE001 (any capture failure: warn, run eagerly)
                error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if error is None and budget is not None and graphs.memory_bytes > budget:
            error = (f"the graphs took {graphs.memory_bytes / 2**20:.0f} MiB, more than the {budget / 2**20:.0f} "
                     f"MiB the KV budget left them")
        if self.tp.size > 1:  # every rank takes the same path in every step, or none uses the graphs
            ok = torch.tensor([0.0 if error else 1.0], device=self.device)
            self.tp.all_reduce(ok)
            if error is None and ok.item() < self.tp.size:
                error = "another tensor-parallel rank failed to capture"
        if error is not None:
            logger.warning("CUDA graph capture failed (%s): every step runs eagerly", error)
            del graphs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            return False
        self.graphs = graphs
        if self.tp.is_first_rank:
            logger.info("CUDA graphs: decode batch sizes %d-%d (%d buckets) %s in %.1f s, %.0f MiB", sizes[0],
                        sizes[-1], len(sizes), "captured" if capture else "set up eagerly", graphs.capture_s,
                        graphs.memory_bytes / 2**20)
        return True

    # --- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | StageTiming | None:
        """The step's output on the sampling rank; under pipeline parallelism a stage's timing on the
        first rank of every stage before the last; None elsewhere. ``received`` and ``handed_over`` are
        set just before a stage reads the previous stage's message and sends its own over the link
        (``Worker.execute_model`` keeps the links in step when the step fails before either)."""
        start = time.perf_counter()
        stage_wait = 0.0
        self.batch.update(scheduler_output)
        batch = self.batch.prepare(scheduler_output)
        batch.attn_meta.deterministic = self.config.deterministic
        forward_start = time.perf_counter()
        # on CUDA the forward is timed by events, so that the step's one synchronisation is the
        # sampler reading the sampled ids (or, in a step that samples nothing, the end event)
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        bucket = self.graphs.bucket(batch.attn_meta) if self.graphs is not None else None
        if bucket is not None:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.attn_meta, bucket)
        else:
            intermediate = None
            if not self.stage.is_first:  # the previous stage's (hidden, residual)
                intermediate = self.stage.recv(self._intermediate_shape(len(batch.input_ids)), self.dtype,
                                               self.device, started=self._receiving)
                stage_wait = time.perf_counter() - forward_start
            hidden = self._forward(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta, intermediate)
            if not self.stage.is_last:
                compute = time.perf_counter() - forward_start - stage_wait
                self.stage.send(hidden, started=self._handing_over)
                return StageTiming(self.stage.rank, stage_wait, compute) if self.tp.is_first_rank else None
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if batch.sample_rows else None
        if events is not None:
            events[1].record()
        forward_time = time.perf_counter() - forward_start
        # prompt logprobs (every rank: the LM head gathers across them); reading them synchronises
        prompt_rows = plan_prompt_rows(batch.req_ids, batch.attn_meta.query_lens, self.batch.requests)
        prompt_logprobs = compute_prompt_logprobs(
            self.model, hidden, prompt_rows, self.tp.is_first_rank,
            min(ROWS_PER_SLICE, self.config.scheduler.max_num_seqs)) if prompt_rows else {}
        if not self.samples:
            return None
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[dict | None] = [None] * len(batch.req_ids)
        if batch.sample_rows:
            rows = [self._sampling_row(self.batch.requests[batch.req_ids[i]]) for i in batch.sample_rows]
            grammar = None
            if scheduler_output.grammar_bitmask is not None:
                grammar = self._grammar_mask(scheduler_output, [batch.req_ids[i] for i in batch.sample_rows])
            token_ids, row_logprobs = self.sampler(logits, rows, grammar)
            for i, token_id, lp in zip(batch.sample_rows, token_ids, row_logprobs):
                sampled[i], logprobs[i] = [token_id], lp
        if events is not None:
            events[1].synchronize()
            forward_time = events[0].elapsed_time(events[1]) / 1000
        return ModelRunnerOutput(batch.req_ids, sampled, logprobs, forward_time - stage_wait,
                                 time.perf_counter() - start, stage_wait_s=stage_wait, prompt_logprobs=prompt_logprobs)

    def _receiving(self) -> None:
        self.received = True

    def _handing_over(self) -> None:
        self.handed_over = True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: PagedAttentionMetadata,
                 intermediate: torch.Tensor | None) -> torch.Tensor:
        """The model (this rank's stage of it): the final hidden states on the last stage, the stacked
        (hidden, residual) the next stage takes on the others."""
        if self.stage.size == 1:
            return self.model(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def _intermediate_shape(self, num_tokens: int) -> tuple[int, ...]:
        """What passes between stages: the model's ``intermediate_shape`` (OPT, Gemma: the hidden state
        alone), else the Llama family's stacked (hidden, residual)."""
        shape = getattr(self.model, "intermediate_shape", None)
        if shape is not None:
            return shape(num_tokens)
        return (2, num_tokens, self.model.args.hidden_size)

    @staticmethod
    def _grammar_mask(so: SchedulerOutput, sampling_ids: list[str]) -> GrammarMask | None:
        """Which logits row (the order of ``sampling_ids``) each bitmask row masks."""
        position = {req_id: i for i, req_id in enumerate(sampling_ids)}
        pairs = [(position[req_id], k) for k, req_id in enumerate(so.grammar_req_ids) if req_id in position]
        if not pairs:
            return None
        return GrammarMask(so.grammar_bitmask, [p[0] for p in pairs], [p[1] for p in pairs])

    def _sampling_row(self, state: RequestState) -> SamplingRow:
        params = state.params
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        return SamplingRow(params, state.token_ids, state.num_prompt_tokens, stop_ids)

    # --- memory profiling ---------------------------------------------------------------------------

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a prefill and a full decode batch once, on a throwaway pool, before serving: the BLAS
        and thread-pool set-up, the first touch of the activation memory and the kernels' scratch
        happen at start instead of in the first requests' steps. The prefill is at most
        ``WARM_UP_PREFILL_TOKENS`` long: the largest one (2048 tokens by default) took 2 s of a
        rank's start on the 2-core VM, and what a larger one would add (more activation memory to
        touch) costs the first such step milliseconds."""
        self.profile_run(WARM_UP_PREFILL_TOKENS, after_prefix=False)
        num_seqs = self._max_decodes()
        self._throwaway_forward([1] * num_seqs, [1] * num_seqs, [[b] for b in range(1, num_seqs + 1)],
                                torch.zeros(num_seqs, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def profile_run(self, max_tokens: int | None = None, after_prefix: bool = True) -> None:
        """A forward pass at the largest batch the scheduler can form (or of ``max_tokens``), with a
        throwaway pool, so the peak activation memory is known before the KV pool takes the rest.

        The chunk is the last one of a ``max_model_len`` sequence (``after_prefix``): it comes after a
        cached prefix of ``max_model_len`` minus the chunk, the costliest prefill attention the engine
        can run (the torch backend gathers and repeats the whole context's K/V for it; a kernel that
        reads the pool in place sizes its tiles and splits by the context). Without the prefix the
        same tokens attend only to themselves, so this bounds that case too; a step of several chunks has
        no more tokens, and the torch backend attends them one at a time, each over at most
        ``max_model_len``. The throwaway pool holds
        one ``max_model_len`` sequence, as ``profile_decode``'s does. ``after_prefix=False``: the chunk
        alone (the CPU warm-up, which touches the activation memory and need not allocate that pool)."""
        max_len = self.config.max_model_len
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, max_len, max_tokens or max_len)
        seq_len = max_len if after_prefix else num_tokens
        num_blocks = -(-seq_len // self.block_size)
        num_rows = min(self.config.scheduler.max_num_seqs, num_tokens)
        logits = self._throwaway_forward([num_tokens], [seq_len], [list(range(1, num_blocks + 1))],
                                         torch.arange(seq_len - num_tokens, seq_len, device=self.device), num_rows)
        if self.sampler is not None:
            self._profile_sampler(logits)

    @torch.inference_mode()
    def profile_decode(self) -> None:
        """A full decode batch at ``max_model_len``: ``max_num_seqs`` decodes, each over a whole
        ``max_model_len`` context, then the sampler over them. Every sequence reads the same blocks of
        a throwaway pool of one sequence's size, so what is measured is the step's transients (the
        torch backend's decode gather, bounded by its slices; the split-KV partials), not the KV."""
        num_seqs, context = self._max_decodes(), self.config.max_model_len
        table = list(range(1, -(-context // self.block_size) + 1))
        logits = self._throwaway_forward([1] * num_seqs, [context] * num_seqs, [table] * num_seqs,
                                         torch.full((num_seqs,), context - 1, dtype=torch.long, device=self.device))
        if self.sampler is not None:
            self._profile_sampler(logits)

    def _max_decodes(self) -> int:
        """The most decodes one step can hold."""
        return min(self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens)

    def _throwaway_forward(self, query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                           positions: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """The model over token id 0 at ``positions`` against a pool of just the blocks ``tables``
        name (freed after), and the logits of the last ``num_rows`` tokens (all by default); planned as
        the engine's steps are (``deterministic`` included), so warm-up and profile run their kernels;
        a hybrid layout's window groups read the same blocks (results are thrown away)."""
        num_blocks = max(b for table in tables for b in table) + 1
        kv_caches = self.layer_caches(allocate_kv_pool(self.kv_spec, num_blocks, self.device))
        meta = PagedAttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device,
                                            self.attention_backend, self.config.deterministic,
                                            [tables] * self.layout.num_window_groups, self.kv_format)
        intermediate = None  # a stage after the first runs on zeros: nothing is sent between stages here
        if not self.stage.is_first:
            intermediate = torch.zeros(self._intermediate_shape(len(positions)), dtype=self.dtype, device=self.device)
        hidden = self._forward(torch.zeros_like(positions), positions, kv_caches, meta, intermediate)
        logits = self.model.compute_logits(hidden[-(num_rows or len(positions)):]) if self.stage.is_last else None
        del kv_caches, hidden
        return logits

    def _profile_sampler(self, logits: torch.Tensor) -> None:
        """The sampler's costliest path over a full batch of rows (penalties, top-k / top-p / min-p, the
        most logprobs, a seed each): its temporaries are part of the step's peak."""
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.5,
                                frequency_penalty=0.5, repetition_penalty=1.1, logprobs=self.config.max_logprobs,
                                max_tokens=None)
        token_ids = list(range(min(64, logits.shape[-1])))
        rows = [SamplingRow(dataclasses.replace(params, seed=i), token_ids, len(token_ids) // 2, ())
                for i in range(logits.shape[0])]
        self.sampler(logits, rows)
