"""The step's metadata that every attention backend reads, and the contract backends implement.

Pool layout, one pair per layer (and per tensor-parallel rank, holding that rank's KV heads)::

    k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim]

(a quantized pool, ``kv_format`` other than "auto": uint8, ``head_dim + 2`` bytes per row, the codes then
the row's bfloat16 scale: ``kernels.kv_quant``).

A token at position ``p`` of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size``. Block 0 is the null block: padding slots point there and nothing reads it back.
A hybrid KV layout (``engine.kv_layout``) gives the window layers their own tables (``window_metas``):
there, entries for blocks wholly below a sequence's window may be 0 or stale (a page another request
now uses, holding anything, NaN included), so a window layer must never let them affect its result:
every backend skips (or does not load) the keys below the lowest window of the rows it attends.

A step's batch is flat (no padding) and ordered decodes first, then prefills::

    tokens:  d0 d1 d2 | p0 p0 p0 p0 p1 p1
             decodes    prefill chunks (each may follow a cached prefix)

Sequence ``s`` owns the query tokens ``[query_start_loc[s], query_start_loc[s + 1])``; its context is
the positions ``[0, seq_lens[s])`` and its i-th query token sits at ``seq_lens[s] - query_len + i``.
Each layer first stores the K/V of every token of the step, then attends: a request may read blocks
that another request of the same step is writing (a prefix-cache hit scheduled in the same step as
the request that fills the blocks), and the store always precedes the reads.

Backends (``kernels.backends`` chooses one) implement the same contract (``AttentionBackend``): ``torch``
(plain torch ops, any device, the fallback), ``cpu`` (compiled kernels that read the pool in place and
run shared-prefix groups) and ``triton``. ``kernels.attention`` holds the one dispatch point.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch


@dataclass
class CascadeGroups:
    """Shared-prefix groups of one step: the member sequences of group g start with the same
    ``lens[g]`` key positions, held in the same physical blocks (``block_tables[g]``), and every
    member's query tokens come after them. A backend that supports groups attends to the shared keys
    once per group and merges each member's own suffix by log-sum-exp; the others ignore them (the
    result is the same)."""

    kv_starts: torch.Tensor  # [num_seqs] int32: the shared length of the sequence's group, 0 outside groups
    block_tables: torch.Tensor  # [num_groups, max_shared_blocks] int32
    lens: torch.Tensor  # [num_groups] int32, multiples of the block size
    member_start: torch.Tensor  # [num_groups + 1] int32: group g's members are members[member_start[g]:...]
    members: torch.Tensor  # [num_members] int32, sequence indices

    @property
    def num_groups(self) -> int:
        return int(self.lens.numel())


@dataclass
class PagedAttentionMetadata:
    """Where the tokens of one step live in the pool; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (null-block padded)
    query_lens: list[int]
    context_lens: list[int]  # seq_lens as Python ints
    num_decodes: int  # the first num_decodes sequences have one query token each
    cascade: CascadeGroups | None = None
    backend: AttentionBackend | None = None  # None: the torch backend
    # batch-invariant results (the engine's ``deterministic``): every row reduces in one fixed order,
    # so a token's output does not depend on the other rows of the step (backends that support it)
    deterministic: bool = False
    # the pool's format (``kernels.kv_quant``): "auto" (the model's dtype) or the quantized codes'
    # ("fp8_e4m3", "fp8_e5m2", "int8"), whose rows carry their scale; one per engine
    kv_format: str = "auto"
    # what the backend derives from this metadata once per step (the Triton backend's launch plan: its
    # tiles on the device), kept with it: a CUDA graph captured over this metadata replays those tensors
    backend_plan: object = None
    # a hybrid KV layout (``engine.kv_layout``): one metadata per window group, the same batch read
    # through that group's tables (its own slots, block tables and shared-prefix groups' blocks); a
    # layer on table g >= 1 attends with ``window_metas[g - 1]``. Empty for a plain layout.
    window_metas: list[PagedAttentionMetadata] = field(default_factory=list)
    # on a window metadata: the step's metadata, whose per-step backend plan it shares (same lengths)
    plan_from: PagedAttentionMetadata | None = field(default=None, repr=False)

    def for_window_group(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         cascade: CascadeGroups | None) -> PagedAttentionMetadata:
        """This step's batch read through a window group's tables: a metadata for ``window_metas``."""
        return replace(self, slot_mapping=slot_mapping, block_tables=block_tables, cascade=cascade,
                       backend_plan=None, window_metas=[], plan_from=self)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu", backend: AttentionBackend | None = None,
              deterministic: bool = False,
              window_block_tables: list[list[list[int]]] = (), kv_format: str = "auto") -> PagedAttentionMetadata:
        """Metadata from plain lists (tests, profiling): slots of each sequence's query positions;
        ``window_block_tables``: per window group, its tables (``window_metas``; no shared-prefix groups)."""
        width = max((len(t) for t in block_tables), default=0)

        def slots_of(tables):
            return torch.tensor([table[p // block_size] * block_size + p % block_size
                                 for q, s, table in zip(query_lens, seq_lens, tables) for p in range(s - q, s)],
                                dtype=torch.long, device=device)

        def padded(tables):
            return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=device).view(-1, width)

        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        int32 = dict(dtype=torch.int32, device=device)
        meta = cls(
            slot_mapping=slots_of(block_tables),
            query_start_loc=torch.tensor(starts, **int32),
            seq_lens=torch.tensor(seq_lens, **int32),
            block_tables=padded(block_tables),
            query_lens=list(query_lens),
            context_lens=list(seq_lens),
            num_decodes=num_decodes,
            backend=backend,
            deterministic=deterministic,
            kv_format=kv_format,
        )
        for tables in window_block_tables:
            if len(tables) != len(block_tables) or any(len(w) != len(t) for w, t in zip(tables, block_tables)):
                raise ValueError("each window group's tables must be parallel to the block tables")
            meta.window_metas.append(meta.for_window_group(slots_of(tables), padded(tables), None))
        return meta


class AttentionBackend(Protocol):
    name: str
    supports_cascade: bool
    supports_deterministic: bool  # honours ``PagedAttentionMetadata.deterministic`` (absent: False)
    layer_ops: object | None  # fused norm / activation / rotary ops for the layers, if the backend has them
    interpreted: bool  # its kernels run under an interpreter (tests): no warm-up at start
    # its kernels read every length from device memory, so a CUDA graph captured over one step's
    # metadata replays correctly for another's (absent: False)
    supports_graphs: bool

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: PagedAttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        """Store ``key``/``value`` ([tokens, kv_heads, d]) in their slots, then attend ``query``
        ([tokens, heads, d]) for the whole batch -> [tokens, heads, d]. ``window`` > 0: the query at
        position p sees only the keys at positions > p - window (a sliding-window layer, transformers'
        mask for Gemma 2/3); ``softcap`` > 0: each scaled score s becomes softcap * tanh(s / softcap)
        before the mask (Gemma 2). Every path (decodes, prefill chunks after a cached prefix,
        shared-prefix groups) honours both."""
        ...
