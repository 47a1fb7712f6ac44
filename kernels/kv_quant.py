"""Quantized KV pools (``kv_cache_dtype``): the formats, the byte layout every backend reads in place, and
the plain-torch quantization that is the reference of the kernels' own.

A quantized pool is a uint8 tensor ``[num_blocks, block_size, kv_heads, head_dim + 2]``: each (token, KV
head) row holds ``head_dim`` one-byte codes, then the row's scale as a bfloat16 (two bytes, little-endian
as the host stores it). A value is ``decode(code) * scale``:

- ``fp8_e4m3`` (``fp8``): codes are float8 e4m3fn (max 448), ``scale = bf16(amax / 448)``;
- ``fp8_e5m2``: float8 e5m2 (max 57344), ``scale = bf16(amax / 57344)``;
- ``int8``: signed bytes, ``scale = bf16(amax / 127)``, codes ``round_half_even(x / scale)``.

``amax`` is the row's largest magnitude; a row whose ``amax / qmax`` rounds to 0 in bfloat16 (a row of
zeros, or one below about 2^-134 x qmax) takes scale 1. The scale is rounded to bfloat16
first and the codes are computed with the rounded scale, clamped to the format's range (float8 e4m3fn has
no infinity: an overflow would be NaN). So a row's bytes depend on that token's K (or V) of that head
alone, never on the tokens stored after it nor on its batch: a cached block's bytes are the same whoever
wrote it, and ``deterministic`` stays batch-invariant. Per-token scales cost 2 bytes per row (head size
64: a row of 66 bytes against 128 in bfloat16, 1.94x the blocks; 256 in float32, 3.88x).

The pool's bytes are the KV: the host tier copies them as they are, and the scheduler sees only bytes per
block (``workers.kv_pool.KVPoolSpec``).
"""

from __future__ import annotations

import torch

# kv_cache_dtype -> the format it names (vLLM's names: "fp8" is e4m3)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
FORMATS = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}
# format -> (its code's torch dtype, the largest code magnitude)
CODES = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0),
         "int8": (torch.int8, 127.0)}
# the compiled kernels' and Triton kernels' number for each format (0: the pool holds the model's dtype)
FORMAT_IDS = {"auto": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}
SCALE_BYTES = 2  # a bfloat16 per (token, KV head) row


def kv_format(kv_cache_dtype: str) -> str:
    """The pool format ``kv_cache_dtype`` names: ``auto`` or one of ``CODES``."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return FORMATS.get(kv_cache_dtype, "auto")


def is_quantized(fmt: str) -> bool:
    return fmt != "auto"


def row_bytes(fmt: str, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one (token, KV head) row of a pool of format ``fmt`` (``dtype``: the model's, for ``auto``)."""
    if not is_quantized(fmt):
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return head_dim + SCALE_BYTES


def pool_dtype_and_width(fmt: str, head_dim: int, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """The pool tensor's dtype and last dimension."""
    return (torch.uint8, head_dim + SCALE_BYTES) if is_quantized(fmt) else (dtype, head_dim)


def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows ``x`` [..., head_dim] (any float dtype) -> their bytes [..., head_dim + 2] (uint8), as above."""
    code_dtype, qmax = CODES[fmt]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / qmax).to(torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # zeros, and rows whose scale rounds to 0
    y = (xf / scale.float()).clamp(-qmax, qmax)
    codes = torch.round(y).to(torch.int8).view(torch.uint8) if fmt == "int8" else y.to(code_dtype).view(torch.uint8)
    return torch.cat([codes, scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bytes [..., head_dim + 2] (uint8) -> values [..., head_dim] in ``dtype``."""
    code_dtype, _ = CODES[fmt]
    codes = rows[..., :-SCALE_BYTES].contiguous().view(code_dtype)
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
    return (codes.float() * scale).to(dtype)


def dequantize_pool(pool: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """A pool (or blocks gathered from it) in the model's dtype: itself where it is not quantized."""
    return dequantize(pool, fmt, dtype) if is_quantized(fmt) else pool
