"""A rank's view of the running requests and the flat batch of each step.

Every request the scheduler has sent holds one row of a persistent int32 block table
(``workers.block_table``), written when its blocks arrive (diffs only) and released when it leaves,
so a step copies its rows out of the table instead of building a table from Python lists. Off CPU
the table has a copy on the device, written by the same diffs: a step sends its new block ids and its
row numbers, and its rows are gathered on the device. A step's batch is flat and ordered decodes
first, then prefill chunks; slots come from the rows: position p of a request lives in slot
``table[row, p // block_size] * block_size + p % block_size``.

A hybrid KV layout (``engine.kv_layout``) adds one table per window group, its rows parallel to the
block table's (the same row per request), written from the diffs' window block ids in the same way;
the step's window slot mappings and rows come from them (``PagedAttentionMetadata.window_metas``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.messages import SchedulerOutput
from engine.sampling_params import SamplingParams
from kernels import AttentionBackend, CascadeGroups, PagedAttentionMetadata
from workers.block_table import BlockTable, DeviceBlockTable
from workers.cascade import plan_cascade, window_group_tables
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
                 cascade: bool, staging_size: int = 4096, long_rope: tuple[int, int] | None = None,
                 num_window_groups: int = 0, kv_format: str = "auto") -> None:
        """``staging_size``: elements of each dtype's staging buffers at start (they grow if a step needs more).
        ``long_rope`` (LongRoPE models: ``RotaryEmbedding.long_rope``): (original length, offset): the
        positions the model gets are offset for requests whose prompt is longer than the original length,
        which selects the long factors' rows of the rotary cache (slots come from the true positions).
        ``num_window_groups``: the hybrid KV layout's window tables (0: a plain layout). ``kv_format``:
        the pool's (every step's metadata carries it)."""
        self.long_rope = long_rope
        self.kv_format = kv_format
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.cascade = cascade and backend.supports_cascade
        self.requests: dict[str, RequestState] = {}
        self.blocks = BlockTable(-(-max_model_len // block_size))
        self.window_blocks = [BlockTable(self.blocks.table.shape[1]) for _ in range(num_window_groups)]
        self.num_cascade_steps = 0  # steps that attended shared-prefix groups
        self.staging: Staging | None = None
        self.device_table: DeviceBlockTable | None = None
        self.device_window_tables: list[DeviceBlockTable] = []
        if device.type != "cpu":
            self.use_staging(Staging(device, initial=staging_size))

    def use_staging(self, staging: Staging) -> None:
        """Send each step's arrays through ``staging`` (one copy per dtype; off a CPU device, pinned
        and non-blocking) and keep the block table's copy on its device (tests run this on CPU)."""
        self.staging = staging
        self.device_table = DeviceBlockTable(self.blocks, staging.device)
        self.device_window_tables = [DeviceBlockTable(t, staging.device) for t in self.window_blocks]

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
            row = self.blocks.add(new.block_ids)
            self._check_window_ids(new.req_id, new.block_ids, new.window_block_ids)
            for table, ids in zip(self.window_blocks, new.window_block_ids):
                table.grow_to(self.blocks.table.shape[0])
                table.append(row, 0, ids)
            self.requests[new.req_id] = RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                row, len(new.block_ids), new.num_computed_tokens,
            )
        for diff in so.scheduled_cached_reqs:
            state = self.requests[diff.req_id]
            state.token_ids.extend(diff.new_token_ids)
            if diff.new_block_ids:
                self.blocks.append(state.row, state.num_blocks, diff.new_block_ids)
                self._check_window_ids(diff.req_id, diff.new_block_ids, diff.new_window_block_ids)
                for table, ids in zip(self.window_blocks, diff.new_window_block_ids):
                    table.append(state.row, state.num_blocks, ids)
                state.num_blocks += len(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def _check_window_ids(self, req_id: str, block_ids: list[int], window_ids: list[list[int]]) -> None:
        if len(window_ids) != len(self.window_blocks) or any(len(w) != len(block_ids) for w in window_ids):
            raise ValueError(f"request {req_id}: {len(self.window_blocks)} window groups' block ids parallel to "
                             f"its {len(block_ids)} blocks expected, got {[len(w) for w in window_ids]}")

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
        token_rows, token_blocks, within = np.repeat(rows, q_lens), positions // bs, positions % bs
        slots = self.blocks.table[token_rows, token_blocks].astype(np.int64) * bs + within
        # the step's rows on the host: for the CPU path's tensors and the shared-prefix plan (off CPU the
        # device gathers its own copy of them)
        host_rows = self.staging is None or self.cascade
        table = self.blocks.table[rows, :width] if host_rows else None

        plan = plan_cascade(table, first, bs) if self.cascade else None
        # each window group: its slots (and its rows on the host; the shared-prefix groups' blocks from them)
        window_arrays, window_tables = [], []
        for wt in self.window_blocks:
            window_arrays.append(wt.table[token_rows, token_blocks].astype(np.int64) * bs + within)
            window_tables.append(wt.table[rows, :width] if host_rows else None)
            if plan is not None:
                window_arrays.append(window_group_tables(plan, window_tables[-1], first, bs))
        if self.long_rope is not None:
            original, offset = self.long_rope
            long = np.array([s.num_prompt_tokens > original for s in ordered], dtype=np.int64)
            positions = positions + np.repeat(long * offset, q_lens)
        arrays = [np.array(input_ids, dtype=np.int64), positions, slots, query_start.astype(np.int32),
                  seq_lens.astype(np.int32), np.array(logits_indices, dtype=np.int64)]
        if plan is not None:
            self.num_cascade_steps += 1
            arrays += [plan.kv_starts, plan.block_tables, plan.lens, plan.member_start, plan.members]
        arrays += window_arrays
        if self.staging is None:  # CPU: the arrays themselves, the table's rows gathered on the host
            tensors = [torch.from_numpy(a) for a in arrays]
            table_t = torch.from_numpy(table)
            window_tables_t = [torch.from_numpy(t) for t in window_tables]
        else:  # the table's new ids and the step's row numbers go with the rest; its rows are gathered there
            writes = [*self.blocks.take_writes()] + [a for wt in self.window_blocks for a in wt.take_writes()]
            tensors = self.staging.upload(arrays + [rows] + writes)
            rows_t = tensors[len(arrays)]
            written = tensors[len(arrays) + 1:]
            self.device_table.apply(*written[:2])
            table_t = self.device_table.gather(rows_t, width)
            window_tables_t = []
            for g, device_table in enumerate(self.device_window_tables):
                device_table.apply(*written[2 + 2 * g:4 + 2 * g])
                window_tables_t.append(device_table.gather(rows_t, width))
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
            kv_format=self.kv_format,
        )
        k = 11 if plan is not None else 6
        for table_g in window_tables_t:
            groups = None
            if plan is not None:
                groups = CascadeGroups(tensors[6], tensors[k + 1], *tensors[8:11])
            meta.window_metas.append(meta.for_window_group(tensors[k], table_g, groups))
            k += 2 if plan is not None else 1
        return StepBatch(
            input_ids=ids,
            positions=positions_t,
            attn_meta=meta,
            req_ids=[s.req_id for s in ordered],
            logits_indices=logits_t,
            sample_rows=sample_rows,
        )
