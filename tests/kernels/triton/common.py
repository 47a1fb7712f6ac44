"""Steps of paged attention built for the Triton tests (here under the interpreter, compiled on CUDA
in ``tests/gpu``): a pool whose null block holds NaN, so that any read of padding poisons the
output, and the naive reference per sequence.

Half-precision results are held to a bound in units of the dtype's spacing, not to an absolute
tolerance: an absolute 2e-3 (float16) or 2e-2 (bfloat16) is below the rounding of outputs near 4
(their spacing is 4e-3 / 3e-2), so over ~10^6 outputs it fails by chance, and it says nothing of
outputs near 0. ``ulp`` is the spacing of the dtype at a value; ``attention_bound`` what a correct
kernel can differ from the float64 result by (see there)."""

from __future__ import annotations

import math
import random

import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention


class Pool:
    def __init__(self, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, seed=0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.k[0] = float("nan")
        self.v[0] = float("nan")
        self.k, self.v = self.k.to(device), self.v.to(device)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def blocks(self, num_tokens):
        return [self.free.pop() for _ in range(-(-num_tokens // self.block_size))]

    def context(self, table, seq_len):
        idx = torch.tensor(table[: -(-seq_len // self.block_size)], device=self.k.device)
        shape = (-1,) + tuple(self.k.shape[2:])
        return self.k[idx].reshape(shape)[:seq_len], self.v[idx].reshape(shape)[:seq_len]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at each |x| (at the smallest normal below it)."""
    info = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(x.double().abs().clamp_min(info.tiny)))) * info.eps


def attention_bound(query, key, value, scale, dtype) -> torch.Tensor:
    """The most a half-precision attention output may differ from the float64 result over the same
    (rounded) inputs: one spacing of the output (it is rounded once, half a spacing, and the float32
    accumulation adds far less), plus the rounding of the softmax weights to ``dtype`` before the
    product with V (tensor cores take both operands in it), each weight off by eps/2 relative, so the
    output by at most eps/2 x sum(p |v|) -- taken twice for slack. sum(p |v|) is the naive attention
    over |V|."""
    ref = naive_causal_attention(query.double(), key.double(), value.double(), scale)
    weighted = naive_causal_attention(query.double(), key.double(), value.double().abs(), scale)
    return ulp(ref, dtype) + torch.finfo(dtype).eps * weighted


def run_step(pool, specs, tables, num_heads, backend, dtype=torch.float32, seed=1, fresh=True):
    """specs: (query_len, seq_len) per sequence, decodes first. The step's K/V are taken from the
    pool and, with ``fresh``, their slots overwritten with garbage first, so only the kernel's own
    store puts them back. Returns the error against the float64 reference, and the output: in
    float32 the largest difference; in half precision the largest difference over
    ``attention_bound`` (at most 1 passes)."""
    gen = torch.Generator().manual_seed(seed)
    device = pool.k.device
    kv_heads, head_dim = pool.k.shape[2], pool.k.shape[3]
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, pool.block_size,
                                        device=device, backend=backend)
    num_tokens = sum(q for q, _ in specs)
    # a strided query, as the model's qkv split makes it
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(device)
    query = qkv[:, :num_heads]
    contexts = [pool.context(t, s) for (_, s), t in zip(specs, tables)]
    key = torch.cat([k[s - q:] for (q, s), (k, _) in zip(specs, contexts)]).clone()
    value = torch.cat([v[s - q:] for (q, s), (_, v) in zip(specs, contexts)]).clone()
    if fresh:
        flat = pool.k.shape[0] * pool.block_size
        pool.k.view(flat, kv_heads, head_dim)[meta.slot_mapping] = 1e4
        pool.v.view(flat, kv_heads, head_dim)[meta.slot_mapping] = 1e4
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(query, key, value, pool.k, pool.v, meta, scale)
    start, worst = 0, 0.0
    for (q, s), (k, v) in zip(specs, contexts):
        q_rows = query[start:start + q].cpu()
        ref = naive_causal_attention(q_rows.double(), k.double().cpu(), v.double().cpu(), scale)
        err = (out[start:start + q].double().cpu() - ref).abs()
        if dtype != torch.float32:
            err = err / attention_bound(q_rows, k.cpu(), v.cpu(), scale, dtype)
        worst = max(worst, err.max().item())
        start += q
    return worst, out


def edge_batch(pool, num_decodes, num_prefills, rng, max_blocks=4):
    """Decodes, then prefill chunks after random prefixes; contexts ending on, before and after block edges."""
    bs = pool.block_size
    specs, tables = [], []
    for i in range(num_decodes + num_prefills):
        n = rng.randint(1, max_blocks)
        seq_len = rng.choice([bs * n, bs * n + 1, max(1, bs * n - 1), rng.randint(1, bs * n)])
        query_len = 1 if i < num_decodes else rng.randint(1, seq_len)
        specs.append((query_len, seq_len))
        tables.append(pool.blocks(seq_len))
    return specs, tables
