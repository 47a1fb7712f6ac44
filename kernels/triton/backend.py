"""The Triton attention backend: the KV store and paged attention read and write the pool in place,
two launches per layer at most (the decodes, then the prefill chunks, each split over its keys where
too few programs would fill the device, with a log-sum-exp merge after), shared-prefix groups
ignored (the result is the same)."""

from __future__ import annotations

import os

import torch

from kernels.attention import PagedAttentionMetadata
from kernels.triton import ops
from kernels.triton.linear import linear_batch_invariant


class TritonLayerOps:
    """The layers' elementwise ops as Triton kernels, shaped like ``kernels.cpu.layer_ops.CpuLayerOps``
    (``linear`` is ``F.linear``: cuBLAS is already the fast path on a GPU; ``linear_fixed_order`` the
    batch-invariant product of ``deterministic``)."""

    rms_norm = staticmethod(ops.rms_norm)
    fused_add_rms_norm = staticmethod(ops.fused_add_rms_norm)
    silu_and_mul = staticmethod(ops.silu_and_mul)
    rotary_neox_ = staticmethod(ops.rotary_neox_)
    linear = staticmethod(torch.nn.functional.linear)
    linear_fixed_order = staticmethod(linear_batch_invariant)


class _Launch:
    """One kernel launch of a step: its tiles on the device and how its keys are split."""

    def __init__(self, seqs: range, meta: PagedAttentionMetadata, block_q: int, num_splits: int) -> None:
        tile_seq, tile_q = ops.attention_tiles(seqs, meta.query_lens, block_q)
        device = meta.query_start_loc.device
        self.tile_seq = torch.tensor(tile_seq, dtype=torch.int32).to(device, non_blocking=True)
        self.tile_q = torch.tensor(tile_q, dtype=torch.int32).to(device, non_blocking=True)
        self.token_begin = sum(meta.query_lens[: seqs.start])
        self.num_tokens = sum(meta.query_lens[seqs.start: seqs.stop])
        self.block_q, self.num_splits = block_q, num_splits


class TritonAttentionBackend:
    """Under ``meta.deterministic`` (``deterministic=True``) a query row's result does not depend on
    the batch: every launch takes the same tile of query rows (decodes and prefill chunks alike, so a
    token is computed the same way in a chunk of any length), the keys are not split (one program
    walks a row's key tiles in order; the key tiles past a row's position add exact zeros), and the
    linear layers run ``kernels.triton.linear`` (fixed tiles, no split of the inner dimension)."""

    name = "triton"
    supports_cascade = False
    supports_deterministic = True
    supports_graphs = True  # every length is read from device memory (``workers.cuda_graphs``)
    deterministic_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    # on a CPU device Triton runs only under its interpreter (TRITON_INTERPRET=1, read at import)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    # The layers' Triton ops (norms, SiLU-and-multiply, rotary) are ``fused_ops``; ``layer_ops`` stays
    # None because the layers' binding of ``layer_ops`` also re-lays out linear weights in host memory
    # and binds the compiled CPU decoder stack, neither of which applies here.
    layer_ops = None
    fused_ops = TritonLayerOps()

    def __init__(self, block_n: int = 32, decode_rows: int = 16, prefill_rows: int = 64,
                 target_programs: int | None = None, min_split_tiles: int = 4, max_splits: int = 32) -> None:
        """``block_n`` keys per tile; ``decode_rows`` / ``prefill_rows`` query rows (tokens x grouped
        heads) per program; the keys of a launch are split when it has fewer than ``target_programs``
        programs (default: twice the multiprocessors of the current CUDA device, else 8), each split
        keeping at least ``min_split_tiles`` key tiles of the longest context."""
        self.block_n, self.decode_rows, self.prefill_rows = block_n, decode_rows, prefill_rows
        if target_programs is None:
            target_programs = 8
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                target_programs = 2 * props.multi_processor_count
        self.target_programs, self.min_split_tiles, self.max_splits = target_programs, min_split_tiles, max_splits
        self.last_plan: list[_Launch] = []  # the latest step's launches (for inspection)

    def num_splits(self, num_tiles: int, kv_heads: int, longest: int) -> int:
        """How many parts to cut each tile's keys into for a launch of ``num_tiles`` tiles."""
        programs = num_tiles * kv_heads
        key_tiles = -(-longest // self.block_n)
        wanted = -(-self.target_programs // max(programs, 1))
        return max(1, min(wanted, key_tiles // self.min_split_tiles, self.max_splits))

    def plan(self, meta: PagedAttentionMetadata, num_heads: int, kv_heads: int) -> list[_Launch]:
        """The step's launches, built once per step and kept on the metadata (``backend_plan``: the
        layers share the metadata, and a CUDA graph captured over it replays the plan's tensors); the
        plan's copy of the lengths notices a metadata object refilled for another step."""
        key = (self.block_n, num_heads, kv_heads, meta.num_decodes, meta.query_lens, meta.context_lens,
               meta.deterministic)
        cached = meta.backend_plan
        if cached is not None and cached[0] == key:
            self.last_plan = cached[1]
            return cached[1]
        group_p2 = 1 << max(0, (num_heads // kv_heads) - 1).bit_length()
        launches = []
        nd, n = meta.num_decodes, meta.num_seqs
        for seqs, rows in ((range(0, nd), self.decode_rows), (range(nd, n), self.prefill_rows)):
            if not len(seqs):
                continue
            block_q = max(1, rows // group_p2)
            if (seqs.start == 0 and seqs.stop == nd) or meta.deterministic:
                block_q = max(1, 16 // group_p2)  # one token per decode: the smallest tile tl.dot takes
            num_tiles = sum(-(-meta.query_lens[s] // block_q) for s in seqs)
            splits = 1 if meta.deterministic else self.num_splits(
                num_tiles, kv_heads, max(meta.context_lens[s] for s in seqs))
            launches.append(_Launch(seqs, meta, block_q, splits))
        meta.backend_plan = ((self.block_n, num_heads, kv_heads, meta.num_decodes, list(meta.query_lens),
                              list(meta.context_lens), meta.deterministic), launches)
        self.last_plan = launches
        return launches

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: PagedAttentionMetadata, scale: float) -> torch.Tensor:
        num_heads, kv_heads = query.shape[1], k_pool.shape[2]
        if num_heads % kv_heads or query.dtype != k_pool.dtype or key.dtype != k_pool.dtype:
            raise ValueError(f"triton attention: {num_heads} query heads of {query.dtype} over {kv_heads} KV heads "
                             f"of {k_pool.dtype} (the heads must divide and the dtypes agree)")
        ops.store_kv(key, value, k_pool, v_pool, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for launch in self.plan(meta, num_heads, kv_heads):
            ops.paged_attention_launch(
                query, k_pool, v_pool, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                launch.tile_seq, launch.tile_q, launch.token_begin, launch.num_tokens, scale,
                launch.block_q, self.block_n, launch.num_splits, use_dot=not (meta.deterministic and ops.INTERPRETED),
            )
        return out
