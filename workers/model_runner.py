"""One rank's step: apply the scheduler's diffs, build the flat batch, run the model shard, and
(rank 0) sample.

A step's batch is flat and ordered decodes first, then prefill chunks (the layout the attention
kernels expect). Slots come from the block tables: position p of a request lives in slot
``block_ids[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.messages import ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from kernels import PagedAttentionMetadata
from workers.kv_pool import KVPoolSpec, allocate_kv_pool
from workers.models.registry import kv_cache_shape, resolve_architecture
from workers.parallel_state import TPGroup
from workers.sampler import Sampler, SamplingRow
from workers.weight_loader import iter_checkpoint


@dataclass
class _RequestState:
    """What this rank knows of a running request (kept in step with the scheduler by diffs)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: PagedAttentionMetadata
    req_ids: list[str]
    logits_indices: torch.Tensor  # flat index of the last token of each request that samples
    sample_rows: list[int]  # which requests (in req_ids order) sample


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        hf_config = config.model.hf_config
        self.model = resolve_architecture(hf_config)(hf_config, tp, dtype, device)
        self.model.load_weights(iter_checkpoint(config.model.path))
        self.model.eval()
        num_layers, kv_heads, head_dim, replicated = kv_cache_shape(hf_config, tp.size)
        self.kv_spec = KVPoolSpec(num_layers, kv_heads, head_dim, self.block_size, dtype, replicated)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.requests: dict[str, _RequestState] = {}
        self.sampler = Sampler(device, config.seed) if tp.is_first_rank else None
        self.eos_token_ids = tuple(config.model.eos_token_ids)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_pool(self.kv_spec, num_blocks, self.device)

    # --- one step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        start = time.perf_counter()
        self._update_states(scheduler_output)
        batch = self._prepare_batch(scheduler_output)
        forward_start = time.perf_counter()
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn_meta)
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if batch.sample_rows else None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        forward_time = time.perf_counter() - forward_start
        if not self.tp.is_first_rank:
            return None
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[dict | None] = [None] * len(batch.req_ids)
        if batch.sample_rows:
            rows = [self._sampling_row(self.requests[batch.req_ids[i]]) for i in batch.sample_rows]
            token_ids, row_logprobs = self.sampler(logits, rows)
            for i, token_id, lp in zip(batch.sample_rows, token_ids, row_logprobs):
                sampled[i], logprobs[i] = [token_id], lp
        return ModelRunnerOutput(batch.req_ids, sampled, logprobs, forward_time, time.perf_counter() - start)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens,
            )
        for diff in so.scheduled_cached_reqs:
            state = self.requests[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def _prepare_batch(self, so: SchedulerOutput) -> _Batch:
        num_scheduled = so.num_scheduled_tokens
        states = [self.requests[req_id] for req_id in num_scheduled]
        decodes = [s for s in states if num_scheduled[s.req_id] == 1]
        ordered = decodes + [s for s in states if num_scheduled[s.req_id] > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for i, state in enumerate(ordered):
            start, n = state.num_computed_tokens, num_scheduled[state.req_id]
            input_ids.extend(state.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == len(state.token_ids):  # reached its last known token: sample the next
                logits_indices.append(len(input_ids) - 1)
                sample_rows.append(i)
        max_blocks = max(len(s.block_ids) for s in ordered)
        table = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in ordered])
        positions_t = torch.tensor(positions)
        token_req = torch.repeat_interleave(torch.arange(len(ordered)), torch.tensor(query_lens))
        slots = table[token_req, positions_t // self.block_size] * self.block_size + positions_t % self.block_size
        nd = len(decodes)
        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        table = to_device(table)
        meta = PagedAttentionMetadata(
            slot_mapping=to_device(slots),
            num_decodes=nd,
            decode_block_tables=table[:nd],
            decode_seq_lens=to_device(torch.tensor(seq_lens[:nd])),
            decode_max_seq_len=max(seq_lens[:nd], default=0),
            prefill_query_lens=query_lens[nd:],
            prefill_seq_lens=seq_lens[nd:],
            prefill_block_tables=table[nd:],
        )
        return _Batch(
            input_ids=to_device(torch.tensor(input_ids)),
            positions=to_device(positions_t),
            attn_meta=meta,
            req_ids=[s.req_id for s in ordered],
            logits_indices=to_device(torch.tensor(logits_indices, dtype=torch.long)),
            sample_rows=sample_rows,
        )

    def _sampling_row(self, state: _RequestState) -> SamplingRow:
        params = state.params
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos_token_ids)
        return SamplingRow(params, state.token_ids, state.num_prompt_tokens, stop_ids)

    # --- memory profiling ---------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass at the largest batch the scheduler can form, with a throwaway pool, so the
        peak activation memory is known before the KV pool takes the rest."""
        num_tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.max_model_len)
        num_blocks = -(-num_tokens // self.block_size) + 1
        kv_caches = allocate_kv_pool(self.kv_spec, num_blocks, self.device)
        positions = torch.arange(num_tokens, device=self.device)
        blocks = torch.arange(1, num_blocks, device=self.device)
        meta = PagedAttentionMetadata(
            slot_mapping=positions + self.block_size,
            num_decodes=0,
            decode_block_tables=blocks[None, :0],
            decode_seq_lens=positions[:0],
            decode_max_seq_len=0,
            prefill_query_lens=[num_tokens],
            prefill_seq_lens=[num_tokens],
            prefill_block_tables=blocks[None, :],
        )
        hidden = self.model(torch.zeros_like(positions), positions, kv_caches, meta)
        num_rows = min(self.config.scheduler.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[-num_rows:])
        del kv_caches, hidden
