"""Paged attention over a block-addressed KV pool.

Pool layout, one pair per layer (and per tensor-parallel rank, holding that rank's KV heads)::

    k_pool, v_pool: [num_blocks, block_size, num_kv_heads, head_dim]

A token at position ``p`` of a request lives in slot ``block_table[p // block_size] * block_size +
p % block_size``. Block 0 is the null block: padding slots point there and nothing reads it back.

A step's batch is flat (no padding) and ordered decodes first, then prefills::

    tokens:  d0 d1 d2 | p0 p0 p0 p0 p1 p1
             decodes    prefill chunks (each may follow a cached prefix)

Each layer first stores the K/V of every token of the step, then attends. A request may therefore
read blocks that another request of the same step is writing (a prefix-cache hit scheduled in the
same step as the request that fills the blocks): the store always precedes the reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedAttentionMetadata:
    """Where the tokens of one step live in the pool; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int  # the first num_decodes tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (null-block padded)
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, context length including the new token
    decode_max_seq_len: int
    prefill_query_lens: list[int]  # tokens computed this step, per prefill request
    prefill_seq_lens: list[int]  # context length including this step's tokens
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int64

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ([num_tokens, kv_heads, head_dim]) into their slots, in place."""
    num_blocks, block_size, kv_heads, head_dim = k_pool.shape
    k_pool.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_pool.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` ([..., n]) of ``pool`` as contiguous [..., n * block_size, kv_heads, d]."""
    _, block_size, kv_heads, head_dim = pool.shape
    out = pool.index_select(0, block_ids.reshape(-1))
    return out.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim)


def paged_decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One query token per request ([batch, heads, d]) against its paged context -> [batch, heads, d].

    Grouped-query attention without repeating K/V: the query heads of one KV head form the
    "query length" axis of a batched attention over that head's keys.
    """
    batch, num_heads, head_dim = query.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks]
    keys = _gather(k_pool, tables).transpose(1, 2)  # [batch, kv_heads, ctx, d]
    values = _gather(v_pool, tables).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    visible = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
    grouped = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for prefill chunks, each after an optional cached prefix.

    ``query``/``key``/``value`` hold the chunks' own tokens, concatenated ([tokens, heads, d]). A chunk
    with no prefix attends to its own K/V directly; one with a prefix reads the whole context from
    the pool (its own K/V were stored there already) with the causal mask shifted by the prefix.
    """
    out = torch.empty_like(query)
    block_size = k_pool.shape[1]
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + query_len
        q = query[start:end].transpose(0, 1)  # [heads, q, d]
        prefix_len = seq_len - query_len
        if prefix_len == 0:
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            blocks = block_tables[i, : -(-seq_len // block_size)]
            k = _gather(k_pool, blocks)[:seq_len].transpose(0, 1)
            v = _gather(v_pool, blocks)[:seq_len].transpose(0, 1)
            rows = torch.arange(prefix_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= rows[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V, then attend for the whole mixed batch ([tokens, heads, d] in and out)."""
    store_kv(key, value, k_pool, v_pool, meta.slot_mapping)
    nd = meta.num_decodes
    if meta.num_prefills == 0:
        return paged_decode_attention(
            query, k_pool, v_pool, meta.decode_block_tables, meta.decode_seq_lens,
            meta.decode_max_seq_len, scale,
        )
    out = torch.empty_like(query)
    if nd:
        out[:nd] = paged_decode_attention(
            query[:nd], k_pool, v_pool, meta.decode_block_tables, meta.decode_seq_lens,
            meta.decode_max_seq_len, scale,
        )
    out[nd:] = paged_prefill_attention(
        query[nd:], key[nd:], value[nd:], k_pool, v_pool, meta.prefill_query_lens,
        meta.prefill_seq_lens, meta.prefill_block_tables, scale,
    )
    return out
