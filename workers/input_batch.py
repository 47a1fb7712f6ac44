"""A rank's view of the running requests and the flat batch of each step.

Every request the scheduler has sent holds one row of a persistent int32 block table
(``workers.block_table``), written when its blocks arrive (diffs only) and released when it leaves,
so a step copies its rows out of the table instead of building a table from Python lists. Off CPU
the table has a copy on the device, written by the same diffs: a step sends its new block ids and its
row numbers, and its rows are gathered on the device. A step's batch is flat and ordered decodes
first, then prefill chunks; slots come from the rows: position p of a request lives in slot
``table[row, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.messages import SchedulerOutput
from engine.sampling_params import SamplingParams
from kernels import AttentionBackend, CascadeGroups, PagedAttentionMetadata
from workers.block_table import BlockTable, DeviceBlockTable
from workers.cascade import plan_cascade
from workers.staging import Staging


@dataclass
class RequestState:
    """What this rank knows of a running request (kept in step with the scheduler by diffs)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    row: int  # its row of the block table
    num_blocks: int
    num_computed_tokens: int


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: PagedAttentionMetadata
    req_ids: list[str]
    logits_indices: torch.Tensor  # flat index of the last token of each request that samples
    sample_rows: list[int]  # which requests (in req_ids order) sample


class InputBatch:
    def __init__(self, block_size: int, max_model_len: int, device: torch.device, backend: AttentionBackend,
                 cascade: bool, staging_size: int = 4096, long_rope: tuple[int, int] | None = None) -> None:
        """``staging_size``: elements of each dtype's staging buffers at start (they grow if a step needs more).
        ``long_rope`` (LongRoPE models: ``RotaryEmbedding.long_rope``): (original length, offset): the
        positions the model gets are offset for requests whose prompt is longer than the original length,
        which selects the long factors' rows of the rotary cache (slots come from the true positions)."""
        self.long_rope = long_rope
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.cascade = cascade and backend.supports_cascade
        self.requests: dict[str, RequestState] = {}
        self.blocks = BlockTable(-(-max_model_len // block_size))
        self.num_cascade_steps = 0  # steps that attended shared-prefix groups
        self.staging: Staging | None = None
        self.device_table: DeviceBlockTable | None = None
        if device.type != "cpu":
            self.use_staging(Staging(device, initial=staging_size))

    def use_staging(self, staging: Staging) -> None:
        """Send each step's arrays through ``staging`` (one copy per dtype; off a CPU device, pinned
        and non-blocking) and keep the block table's copy on its device (tests run this on CPU)."""
        self.staging = staging
        self.device_table = DeviceBlockTable(self.blocks, staging.device)

    def update(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diffs: drop finished/preempted requests, add new ones, extend the rest."""
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.blocks.release(state.row)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self.blocks.release(old.row)
            self.requests[new.req_id] = RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                self.blocks.add(new.block_ids), len(new.block_ids), new.num_computed_tokens,
            )
        for diff in so.scheduled_cached_reqs:
            state = self.requests[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            if diff.new_block_ids:
                self.blocks.append(state.row, state.num_blocks, diff.new_block_ids)
                state.num_blocks += len(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def prepare(self, so: SchedulerOutput) -> StepBatch:
        num_scheduled = so.num_scheduled_tokens
        states = [self.requests[req_id] for req_id in num_scheduled]
        ordered = [s for s in states if num_scheduled[s.req_id] == 1]
        num_decodes = len(ordered)
        ordered += [s for s in states if num_scheduled[s.req_id] > 1]
        num_seqs = len(ordered)
        query_lens = [num_scheduled[s.req_id] for s in ordered]
        starts = [s.num_computed_tokens for s in ordered]
        input_ids: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for i, (state, start, n) in enumerate(zip(ordered, starts, query_lens)):
            if n == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:start + n])
            if start + n == len(state.token_ids):  # reached its last known token: sample the next
                logits_indices.append(len(input_ids) - 1)
                sample_rows.append(i)

        bs = self.block_size
        q_lens = np.array(query_lens, dtype=np.int64)
        first = np.array(starts, dtype=np.int64)
        seq_lens = first + q_lens
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1] - first, q_lens)
        width = -(-int(seq_lens.max()) // bs)
        rows = np.array([s.row for s in ordered], dtype=np.int64)
        slots = self.blocks.table[np.repeat(rows, q_lens), positions // bs].astype(np.int64) * bs + positions % bs
        # the step's rows on the host: for the CPU path's tensors and the shared-prefix plan (off CPU the
        # device gathers its own copy of them)
        table = self.blocks.table[rows, :width] if self.staging is None or self.cascade else None

        plan = plan_cascade(table, first, bs) if self.cascade else None
        if self.long_rope is not None:
            original, offset = self.long_rope
            long = np.array([s.num_prompt_tokens > original for s in ordered], dtype=np.int64)
            positions = positions + np.repeat(long * offset, q_lens)
        arrays = [np.array(input_ids, dtype=np.int64), positions, slots, query_start.astype(np.int32),
                  seq_lens.astype(np.int32), np.array(logits_indices, dtype=np.int64)]
        if plan is not None:
            self.num_cascade_steps += 1
            arrays += [plan.kv_starts, plan.block_tables, plan.lens, plan.member_start, plan.members]
        if self.staging is None:  # CPU: the arrays themselves, the table's rows gathered on the host
            tensors = [torch.from_numpy(a) for a in arrays]
            table_t = torch.from_numpy(table)
        else:  # the table's new ids and the step's row numbers go with the rest; its rows are gathered there
            tensors = self.staging.upload(arrays + [rows, *self.blocks.take_writes()])
            rows_t, index_t, values_t = tensors[-3:]
            self.device_table.apply(index_t, values_t)
            table_t = self.device_table.gather(rows_t, width)
        ids, positions_t, slots_t, query_start_t, seq_lens_t, logits_t = tensors[:6]
        meta = PagedAttentionMetadata(
            slot_mapping=slots_t,
            query_start_loc=query_start_t,
            seq_lens=seq_lens_t,
            block_tables=table_t,
            query_lens=query_lens,
            context_lens=seq_lens.tolist(),
            num_decodes=num_decodes,
            cascade=CascadeGroups(*tensors[6:11]) if plan is not None else None,
            backend=self.backend,
        )
        return StepBatch(
            input_ids=ids,
            positions=positions_t,
            attn_meta=meta,
            req_ids=[s.req_id for s in ordered],
            logits_indices=logits_t,
            sample_rows=sample_rows,
        )
