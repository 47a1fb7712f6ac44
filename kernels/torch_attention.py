"""The plain-torch attention backend: runs on any device and is the fallback where the compiled
kernels are not available. Decode gathers each sequence's blocks into contiguous K/V and runs one
batched SDPA with grouped-query heads folded into the query axis; a prefill chunk without a prefix
attends to its own K/V, one after a cached prefix reads its context from the pool with a bottom-right
aligned causal mask. Shared-prefix groups are ignored (the result is the same).

A prefill's SDPA takes 4-D tensors ([1, heads, q, d]) with the K/V heads repeated to the query heads
and no dense mask (``is_causal``, or ``causal_lower_right`` after a prefix), so that a fused kernel
(flash, memory-efficient; CPU flash) can run it: 3-D inputs, an explicit mask on CUDA's flash kernel,
or unequal heads on the memory-efficient kernel send SDPA to its math path, which materialises the
whole [heads, q, context] score matrix (32 GiB in float32 for a 2048-token chunk after a 128k-token
prefix at 32 heads). The repeated K/V cost heads x context x d, a small part of that.

A sliding window (``window``) is a boolean mask beside the causal one (SDPA still runs it; a decode
gathers and a prefill reads only the blocks its window reaches: a hybrid KV layout's window table may
name stale pages below it); soft-capped scores (``softcap``) cannot go through SDPA, so
those layers compute the scores, cap, mask and softmax in plain torch (``_explicit_attention``: the
[heads, q, keys] scores of one sequence, or of one decode slice, are materialised).

The decode gather is the one transient that grows with the batch and its contexts: decodes are
attended in slices whose gathered K/V stay within ``DECODE_GATHER_BYTES`` (each slice gathering up
to its own longest context), so a long-context decode batch cannot take more memory than that.

A quantized pool (``meta.kv_format``, ``kernels.kv_quant``) is this backend's reference: each stored row
is quantized as ``kv_quant.quantize`` does, and every key and value a query reads, its own chunk's
included, is the dequantized stored row (gathered blocks dequantized to the query's dtype), as the
compiled and Triton kernels read them in place. So a token's attention is the same whether its prefix
was cached or computed in the same chunk."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_pool, is_quantized, quantize
from kernels.metadata import PagedAttentionMetadata


DECODE_GATHER_BYTES = 256 * 2**20  # the most K + V one decode slice gathers out of the pool


def decode_slices(context_lens: list[int], bytes_per_token: int, budget: int = 0) -> list[tuple[int, int, int]]:
    """(start, end, longest context) of consecutive decodes whose gathered K/V (slice size x its
    longest context x ``bytes_per_token``) stay within ``budget`` (default ``DECODE_GATHER_BYTES``);
    a decode whose context alone exceeds it is a slice of its own."""
    budget = budget or DECODE_GATHER_BYTES
    slices: list[tuple[int, int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(context_lens):
        if i > start and (i + 1 - start) * max(longest, n) * bytes_per_token > budget:
            slices.append((start, i, longest))
            start, longest = i, 0
        longest = max(longest, n)
    if context_lens:
        slices.append((start, len(context_lens), longest))
    return slices


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str = "auto",
) -> None:
    """Write ``key``/``value`` ([num_tokens, kv_heads, head_dim]) into their slots, in place (quantized
    rows where the pool is)."""
    num_blocks, block_size, kv_heads, width = k_pool.shape
    if is_quantized(kv_format):
        key, value = quantize(key, kv_format), quantize(value, kv_format)
    k_pool.view(num_blocks * block_size, kv_heads, width).index_copy_(0, slot_mapping, key)
    v_pool.view(num_blocks * block_size, kv_heads, width).index_copy_(0, slot_mapping, value)


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, kv_format: str = "auto",
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` ([..., n]) of ``pool`` as contiguous [..., n * block_size, kv_heads, d]
    (a quantized pool's rows dequantized to ``dtype``)."""
    _, block_size, kv_heads, width = pool.shape
    out = pool.index_select(0, block_ids.reshape(-1))
    out = out.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, width)
    return dequantize_pool(out, kv_format, dtype)


def paged_decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_format: str = "auto",
) -> torch.Tensor:
    """One query token per request ([batch, heads, d]) against its paged context -> [batch, heads, d]."""
    batch, num_heads, head_dim = query.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    if window:  # only the blocks from the one holding each query's lowest key (stale pages below: not read)
        span = min(num_blocks, (window - 1) // block_size + 2)  # the most blocks a window's keys touch
        first_block = (seq_lens.long() - window).clamp(min=0) // block_size
        columns = first_block[:, None] + torch.arange(span, device=query.device)
        tables = torch.gather(block_tables, 1, columns.clamp(max=block_tables.shape[1] - 1))
        positions = (first_block[:, None] * block_size + torch.arange(span * block_size, device=query.device))
    else:
        tables = block_tables[:, :num_blocks]
        positions = torch.arange(num_blocks * block_size, device=query.device)[None, :]
    keys = _gather(k_pool, tables, kv_format, query.dtype).transpose(1, 2)  # [batch, kv_heads, ctx, d]
    values = _gather(v_pool, tables, kv_format, query.dtype).transpose(1, 2)
    visible = positions < seq_lens[:, None]
    if window:  # the query sits at seq_len - 1: it sees positions > seq_len - 1 - window
        visible &= positions >= seq_lens[:, None] - window
    visible = visible[:, None, None, :]
    grouped = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    if window or softcap:  # explicit: padding slots past a short context must weigh exactly 0 here
        out = _explicit_attention(grouped, keys, values, visible, scale, softcap)
    else:
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
    window: int = 0,
    softcap: float = 0.0,
    kv_format: str = "auto",
) -> torch.Tensor:
    """Causal attention for prefill chunks ([tokens, heads, d], concatenated), each after an
    optional cached prefix (read from the pool, where the chunk's own K/V were stored already; a
    quantized pool is always read, so that the chunk sees its own keys as stored)."""
    out = torch.empty_like(query)
    block_size = k_pool.shape[1]
    start = 0
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        end = start + query_len
        skip = 0  # keys before the block of the chunk's lowest visible key are not read (stale pages)
        if seq_len == query_len and not is_quantized(kv_format):
            k, v = key[start:end], value[start:end]
        else:
            if window:
                skip = max(0, seq_len - query_len + 1 - window) // block_size * block_size
            blocks = block_tables[i, skip // block_size: -(-seq_len // block_size)]
            k = _gather(k_pool, blocks, kv_format, query.dtype)[:seq_len - skip]
            v = _gather(v_pool, blocks, kv_format, query.dtype)[:seq_len - skip]
        if window or softcap:
            out[start:end] = _windowed_attention(query[start:end], k, v, scale, window, softcap, skip)
        else:
            out[start:end] = _causal_sdpa(query[start:end], k, v, scale)
        start = end
    return out


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                        softcap: float) -> torch.Tensor:
    """softmax(mask(softcap * tanh(q k^T * scale / softcap))) v (no cap where ``softcap`` is 0), as
    transformers' eager attention computes it; ``q`` [..., m, d] against ``k``/``v`` [..., n, d],
    ``visible`` broadcast to [..., m, n]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    v = v.masked_fill(~visible.any(dim=-2).unsqueeze(-1), 0.0)  # padding slots (any value) weigh exactly 0
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, window: int,
                        softcap: float, offset: int = 0) -> torch.Tensor:
    """``_causal_sdpa`` with a sliding window and/or soft-capped scores: only the keys the chunk's
    first query's window reaches are read, the mask is explicit. ``key``/``value`` hold the positions
    from ``offset`` on."""
    q_len, num_heads, _ = query.shape
    first = offset + key.shape[0] - q_len  # the first query's position
    lo = max(0, first + 1 - window) if window else 0
    positions = torch.arange(first, first + q_len, device=query.device)[:, None]
    keys = torch.arange(lo, offset + key.shape[0], device=query.device)[None, :]
    visible = keys <= positions
    if window:
        visible &= keys > positions - window
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = _heads_first(key[lo - offset:], num_heads), _heads_first(value[lo - offset:], num_heads)
    if softcap:
        o = _explicit_attention(q, k, v, visible, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return o[0].transpose(0, 1)


def _heads_first(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[tokens, kv_heads, d] -> [1, num_heads, tokens, d], each K/V head repeated for its query heads."""
    x = x.transpose(0, 1)
    if x.shape[0] != num_heads:
        x = x.repeat_interleave(num_heads // x.shape[0], dim=0)
    return x.unsqueeze(0)


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """``query`` [q, heads, d], the last q positions of ``key``/``value`` [k, kv_heads, d] (k >= q),
    attending causally -> [q, heads, d]. 4-D inputs, equal heads and no dense mask: every fused SDPA
    kernel is eligible (the memory-efficient one has no grouped-query support, hence the repeat)."""
    q_len, num_heads, _ = query.shape
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = _heads_first(key, num_heads), _heads_first(value, num_heads)
    if key.shape[0] == q_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # a chunk after a cached prefix: query i sees keys 0 .. prefix + i
        # imported here: torch.nn.attention.bias imports torch._dynamo, about 2 s of every process's start
        # (the compiled CPU kernels never come here; on CUDA the start-up profile's chunk does, before ready)
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, key.shape[0]), scale=scale)
    return o[0].transpose(0, 1)


class TorchAttentionBackend:
    name = "torch"
    supports_cascade = False
    supports_quantized_kv = True  # the reference of the quantized pool (``kernels.kv_quant``)
    interpreted = False
    layer_ops = None  # the layers keep their plain torch ops

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: PagedAttentionMetadata, scale: float, window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        fmt = meta.kv_format
        store_kv(key, value, k_pool, v_pool, meta.slot_mapping, fmt)
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        out = torch.empty_like(query)
        if nd:
            block_size, kv_heads, width = k_pool.shape[1:]
            per_token = 2 * kv_heads * query.shape[-1] * query.element_size()
            if is_quantized(fmt):  # the gathered rows, their codes in float32 and the float32 product too
                per_token += 2 * kv_heads * (width + 8 * query.shape[-1])
            blocks = [-(-n // block_size) * block_size for n in meta.context_lens[:nd]]
            for start, end, longest in decode_slices(blocks, per_token):
                out[start:end] = paged_decode_attention(
                    query[start:end], k_pool, v_pool, meta.block_tables[start:end], meta.seq_lens[start:end],
                    longest, scale, window, softcap, fmt,
                )
            if nd == num_seqs:
                return out
        out[nd:] = paged_prefill_attention(
            query[nd:], key[nd:], value[nd:], k_pool, v_pool, meta.query_lens[nd:], meta.context_lens[nd:],
            meta.block_tables[nd:], scale, window, softcap, fmt,
        )
        return out


TORCH_BACKEND = TorchAttentionBackend()
