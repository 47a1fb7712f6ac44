"""The Triton attention backend: the KV store and paged attention read and write the pool in place,
two launches per layer at most (the decodes, then the prefill chunks, each split over its keys where
too few programs would fill the device, with a log-sum-exp merge after), shared-prefix groups
ignored (the result is the same)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.kv_quant import FORMAT_IDS
from kernels.metadata import PagedAttentionMetadata
from kernels.triton import ops
from kernels.triton.linear import linear_batch_invariant
from kernels.triton.moe import fused_moe


class TritonLayerOps:
    """The layers' elementwise ops as Triton kernels, shaped like ``kernels.cpu.layer_ops.CpuLayerOps``
    (``linear`` is ``F.linear``: cuBLAS is already the fast path on a GPU; ``linear_fixed_order`` the
    batch-invariant product of ``deterministic``; ``fused_moe`` the experts of a MoE layer)."""

    rms_norm = staticmethod(ops.rms_norm)
    fused_add_rms_norm = staticmethod(ops.fused_add_rms_norm)
    silu_and_mul = staticmethod(ops.silu_and_mul)
    rotary_neox_ = staticmethod(ops.rotary_neox_)
    linear = staticmethod(torch.nn.functional.linear)
    linear_fixed_order = staticmethod(linear_batch_invariant)
    fused_moe = staticmethod(fused_moe)  # mixture-of-experts layers: grouped GEMM over expert-sorted pairs


def attention_tiles(seqs: range, query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(sequence, first query token) of every tile of ``block_q`` query tokens of ``seqs``."""
    tile_seq, tile_q = [], []
    for s in seqs:
        for q in range(0, query_lens[s], block_q):
            tile_seq.append(s)
            tile_q.append(q)
    return tile_seq, tile_q


class _Launch:
    """One kernel launch of a step: its tiles on the device and how its keys are split."""

    def __init__(self, seqs: range, meta: PagedAttentionMetadata, block_q: int, num_splits: int) -> None:
        tile_seq, tile_q = attention_tiles(seqs, meta.query_lens, block_q)
        device = meta.query_start_loc.device
        self.tile_seq = torch.tensor(tile_seq, dtype=torch.int32).to(device, non_blocking=True)
        self.tile_q = torch.tensor(tile_q, dtype=torch.int32).to(device, non_blocking=True)
        self.token_begin = sum(meta.query_lens[: seqs.start])
        self.num_tokens = sum(meta.query_lens[seqs.start: seqs.stop])
        self.block_q, self.num_splits = block_q, num_splits


@dataclass(frozen=True)
class AttentionShape:
    """What an engine's configuration fixes about its attention launches (one tensor-parallel rank):
    the variants it can compile (``kernels.triton.warmup``) and the split-KV scratch it needs."""

    dtype: torch.dtype
    num_heads: int  # query heads of this rank
    kv_heads: int  # KV heads of this rank
    head_dim: int
    block_size: int
    max_decodes: int  # the most decode rows one step holds (max_num_seqs, within the token budget)
    max_model_len: int
    deterministic: bool = False
    kv_format: str = "auto"  # the pool's format (``kernels.kv_quant``): a quantized one is its own variants


class TritonAttentionBackend:
    """Under ``meta.deterministic`` (``deterministic=True``) a query row's result does not depend on
    the batch: every launch takes the same tile of query rows (decodes and prefill chunks alike, so a
    token is computed the same way in a chunk of any length), the keys are not split (one program
    walks a row's key tiles in order; the key tiles past a row's position add exact zeros), and the
    linear layers run ``kernels.triton.linear`` (fixed tiles, no split of the inner dimension).

    Split counts are powers of two up to ``max_splits`` (each count is its own compiled variant),
    and a launch's splits times its tokens never pass the rows of the split-KV scratch: one buffer
    for every launch, allocated once (``prepare``, before the engine's memory profile, for
    ``scratch_rows``; else, outside an engine, at the first launch for ``default_scratch_rows``)."""

    name = "triton"
    supports_cascade = False
    supports_deterministic = True
    supports_graphs = True  # every length is read from device memory (``workers.cuda_graphs``)
    # quantized pools (``meta.kv_format``, ``kernels.kv_quant``): the store quantizes each row in the kernel, the
    # attention reads the codes and scales in place and dequantizes them in registers
    supports_quantized_kv = True
    deterministic_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    # on a CPU device Triton runs only under its interpreter (TRITON_INTERPRET=1, read at import)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    # The layers' Triton ops (norms, SiLU-and-multiply, rotary) are ``fused_ops``; ``layer_ops`` stays
    # None because the layers' binding of ``layer_ops`` also re-lays out linear weights in host memory
    # and binds the compiled CPU decoder stack, neither of which applies here.
    layer_ops = None
    fused_ops = TritonLayerOps()

    def __init__(self, block_n: int = 32, decode_rows: int = 16, prefill_rows: int = 64,
                 target_programs: int | None = None, min_split_tiles: int = 4, max_splits: int = 32,
                 default_scratch_rows: int = 2048) -> None:
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
        if max_splits < 1 or max_splits & (max_splits - 1):
            raise ValueError(f"max_splits must be a power of two, not {max_splits}")
        self.target_programs, self.min_split_tiles, self.max_splits = target_programs, min_split_tiles, max_splits
        self.default_scratch_rows = default_scratch_rows
        self.shape: AttentionShape | None = None  # what ``prepare`` was told
        self.scratch: ops.SplitScratch | None = None
        self.last_plan: list[_Launch] = []  # the latest step's launches (for inspection)

    # --- set-up ---------------------------------------------------------------------------------------

    def scratch_rows(self, shape: AttentionShape) -> int:
        """Rows of split-KV scratch an engine of ``shape`` needs: a launch of ``d`` decodes has ``d x
        kv_heads`` programs and takes at most ``ceil(target_programs / (d x kv_heads))`` splits, so
        ``d`` times that is at most ``target_programs / kv_heads + d`` rows; prefill launches take no
        more splits than the scratch holds for their tokens (``num_splits``)."""
        most = max(1, shape.max_decodes)
        return min(most * self.max_splits, -(-self.target_programs // shape.kv_heads) + most)

    def prepare(self, shape: AttentionShape, device: torch.device) -> None:
        """Allocate the split-KV scratch for ``shape`` on ``device`` (``scratch_rows``): called before
        the engine's memory profile, whose peak then counts it."""
        self.shape = shape
        self.scratch = ops.SplitScratch(self.scratch_rows(shape), shape.num_heads, shape.head_dim, device)

    def _scratch(self, query: torch.Tensor) -> ops.SplitScratch:
        num_heads, head_dim = query.shape[1], query.shape[2]
        if self.scratch is not None and self.scratch.fits(num_heads, head_dim, query.device):
            return self.scratch
        if self.shape is not None:  # a new buffer would leave CUDA graphs captured over the old one reading freed memory
            raise ValueError(f"triton attention was prepared for {self.shape.num_heads} heads of size "
                             f"{self.shape.head_dim}, not {num_heads} of size {head_dim}")
        self.scratch = ops.SplitScratch(self.default_scratch_rows, num_heads, head_dim, query.device)
        return self.scratch

    # --- planning ---------------------------------------------------------------------------------------

    def block_q(self, decodes: bool, group: int, deterministic: bool, head_dim: int) -> int:
        """Query tokens per tile of a launch of the step's decodes (else of its prefill chunks). A
        prefill tile holds ``prefill_rows`` query rows, at most 8192 values with the head padded
        (32 rows at head size 256: 64 rows of float32 took 9-14 s to compile for one variant and
        would hold a 64 KiB accumulator per program)."""
        group_p2 = 1 << max(0, group - 1).bit_length()
        if decodes or deterministic:
            return max(1, 16 // group_p2)  # one token per decode: the smallest tile tl.dot takes
        head_p2 = max(16, 1 << max(0, head_dim - 1).bit_length())
        rows = max(16, min(self.prefill_rows, 8192 // head_p2))
        return max(1, rows // group_p2)

    def num_splits(self, num_tiles: int, kv_heads: int, longest: int, num_tokens: int = 1) -> int:
        """How many parts to cut each tile's keys into for a launch of ``num_tiles`` tiles: the
        largest power of two at most what fills ``target_programs``, what leaves each part
        ``min_split_tiles`` key tiles of the ``longest`` context, ``max_splits``, and what the
        scratch holds for ``num_tokens`` tokens."""
        programs = num_tiles * kv_heads
        key_tiles = -(-longest // self.block_n)
        wanted = -(-self.target_programs // max(programs, 1))
        rows = self.scratch.rows if self.scratch is not None else self.default_scratch_rows
        most = max(1, min(wanted, key_tiles // self.min_split_tiles, self.max_splits, rows // max(1, num_tokens)))
        return 1 << (most.bit_length() - 1)

    def split_counts(self, kv_heads: int, max_model_len: int) -> list[int]:
        """Every split count ``num_splits`` can answer for launches over contexts up to ``max_model_len``
        (any launch of one tile and one token reaches the largest; a shorter longest context, each
        smaller power of two)."""
        top = self.num_splits(1, kv_heads, max_model_len, 1)
        return [1 << i for i in range(top.bit_length())]

    def plan(self, meta: PagedAttentionMetadata, num_heads: int, kv_heads: int, head_dim: int = 128) -> list[_Launch]:
        """The step's launches, built once per step and kept on the metadata (``backend_plan``: the
        layers share the metadata, and a CUDA graph captured over it replays the plan's tensors); the
        plan's copy of the lengths notices a metadata object refilled for another step. A window
        group's metadata (``plan_from``: the same lengths) shares the step's plan."""
        meta = meta.plan_from or meta
        key = (self.block_n, num_heads, kv_heads, head_dim, meta.num_decodes, meta.query_lens, meta.context_lens,
               meta.deterministic)
        cached = meta.backend_plan
        if cached is not None and cached[0] == key:
            self.last_plan = cached[1]
            return cached[1]
        launches = []
        nd, n = meta.num_decodes, meta.num_seqs
        for seqs in (range(nd), range(nd, n)):
            if not len(seqs):
                continue
            block_q = self.block_q(seqs.stop == nd, num_heads // kv_heads, meta.deterministic, head_dim)
            num_tiles = sum(-(-meta.query_lens[s] // block_q) for s in seqs)
            num_tokens = sum(meta.query_lens[s] for s in seqs)
            splits = 1 if meta.deterministic else self.num_splits(
                num_tiles, kv_heads, max(meta.context_lens[s] for s in seqs), num_tokens)
            launches.append(_Launch(seqs, meta, block_q, splits))
        meta.backend_plan = ((self.block_n, num_heads, kv_heads, head_dim, meta.num_decodes, list(meta.query_lens),
                              list(meta.context_lens), meta.deterministic), launches)
        self.last_plan = launches
        return launches

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: PagedAttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        num_heads, kv_heads = query.shape[1], k_pool.shape[2]
        kv_format = FORMAT_IDS[meta.kv_format]
        # a quantized pool is uint8 whatever the model's dtype (the query's, the key's and the output's)
        pool_dtype = torch.uint8 if kv_format else query.dtype
        if num_heads % kv_heads or key.dtype != query.dtype or k_pool.dtype != pool_dtype or v_pool.dtype != pool_dtype:
            raise ValueError(f"triton attention: {num_heads} query heads of {query.dtype} over {kv_heads} KV heads "
                             f"of {k_pool.dtype} in KV format {meta.kv_format!r} (the heads must divide and the "
                             f"dtypes agree)")
        ops.store_kv(key, value, k_pool, v_pool, meta.slot_mapping, kv_format)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        scratch = self._scratch(query)
        for launch in self.plan(meta, num_heads, kv_heads, query.shape[2]):
            ops.paged_attention_launch(
                query, k_pool, v_pool, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                launch.tile_seq, launch.tile_q, launch.token_begin, launch.num_tokens, scale,
                launch.block_q, self.block_n, launch.num_splits, use_dot=not (meta.deterministic and ops.INTERPRETED),
                scratch=scratch, window=window, softcap=softcap, kv_format=kv_format,
            )
        return out
