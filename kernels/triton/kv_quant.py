"""Quantized KV pools in the Triton kernels (``kernels.kv_quant``: THE byte layout): the row decode and
encode that ``kernels.triton.ops``' attention and store kernels inline when their ``KV_FORMAT`` constexpr is
not 0 (0: the model's dtype, compiled as it always has been).

KV_FORMAT (a constexpr: format 0 compiles as it always has): 0 the model's dtype, 1 float8 e4m3fn, 2 float8
e5m2, 3 int8 (``kernels.kv_quant.FORMAT_IDS``). A row is HEAD_DIM one-byte codes, then its scale as a
bfloat16 (low byte first). Codes are decoded arithmetically, not through Triton's float8 types: sm_80 has no
e4m3 conversion, and the interpreter's float8 rounding is not torch's. Both float8 formats decode exactly
through float16: e5m2 is a float16's high byte; e4m3's sign, 4 exponent and 3 mantissa bits placed in a
float16 (sign, exponent + 8 below its bias, mantissa) give the value / 256, subnormals included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import SCALE_BYTES


def check_pool(where: str, pool: torch.Tensor, head_dim: int, kv_format: int) -> None:
    """A pool of format ``kv_format`` (an id) for heads of ``head_dim``: the model's dtype and ``head_dim``
    wide, or (quantized) uint8 rows of ``head_dim`` codes and the scale's bytes."""
    width = head_dim + (SCALE_BYTES if kv_format else 0)
    if pool.shape[-1] != width or (kv_format and pool.dtype != torch.uint8):
        raise ValueError(f"{where}: a pool of {pool.dtype} rows of {pool.shape[-1]} for heads of {head_dim} "
                         f"in KV format {kv_format}")


@triton.jit
def decode_codes(codes, KV_FORMAT: tl.constexpr):
    """uint8 codes -> their float32 values (without the scale)."""
    c = codes.to(tl.int32)
    if KV_FORMAT == 1:  # e4m3fn: s eeee mmm -> float16 s 0eeee mmm0000000, times 2**8
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        return half.to(tl.float32) * 256.0
    elif KV_FORMAT == 2:  # e5m2: the high byte of a float16
        return (c << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # int8: two's complement
        return (c - ((c & 0x80) << 1)).to(tl.float32)


@triton.jit
def load_quantized(row_ptr, dims, mask, row_mask, HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr):
    """The dequantized rows [R, HEAD_P2] (float32) of the pool rows starting at ``row_ptr`` [R] (uint8):
    each code times its row's bfloat16 scale (the two bytes after the codes); masked entries 0."""
    codes = tl.load(row_ptr[:, None] + dims[None, :], mask=mask, other=0)
    lo = tl.load(row_ptr + HEAD_DIM, mask=row_mask, other=0).to(tl.int32)
    hi = tl.load(row_ptr + (HEAD_DIM + 1), mask=row_mask, other=0).to(tl.int32)
    scale = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)  # a bfloat16 is a float32's high half
    return decode_codes(codes, KV_FORMAT) * scale[:, None]


@triton.jit
def quantize_rows(x, KV_FORMAT: tl.constexpr):
    """float32 rows x [R, HEAD_P2] (padding 0) -> (codes [R, HEAD_P2] int32 in 0..255, scale bits [R] int32,
    a bfloat16's), exactly ``kernels.kv_quant.quantize``: scale = bf16_rne(amax / qmax) (1 for a row of
    zeros), codes = rne(clamp(x / scale, -qmax, qmax)) in the format. The divisions are IEEE (div_rn: Triton's
    ``/`` is an approximation on NVIDIA), the roundings integer and float32 arithmetic (exact everywhere)."""
    if KV_FORMAT == 1:
        QMAX: tl.constexpr = 448.0
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        SUB: tl.constexpr = 512.0  # 1 / the subnormals' spacing, 2**(BIAS - 1 + MANT)
    elif KV_FORMAT == 2:
        QMAX: tl.constexpr = 57344.0
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        SUB: tl.constexpr = 65536.0
    else:
        QMAX: tl.constexpr = 127.0
        MANT: tl.constexpr = 0
        BIAS: tl.constexpr = 0
        SUB: tl.constexpr = 1.0
    amax = tl.max(tl.abs(x), 1)
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    ratio = tl.where(amax > 0, ratio, 1.0)
    bits = ratio.to(tl.uint32, bitcast=True)
    scale_bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int32)  # round to nearest even (finite > 0)
    scale_bits = tl.where(scale_bits > 0, scale_bits, 0x3F80)  # a scale rounded to 0 is 1 (bfloat16 1.0)
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KV_FORMAT == 3:
        r = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds |y| < 2**22 half to even
        codes = r.to(tl.int32) & 0xFF
    else:
        ybits = y.to(tl.uint32, bitcast=True)
        sign = ((ybits >> 24) & 0x80).to(tl.int32)
        a = tl.abs(y)
        # the spacing of the format's values at |y|: 2**(max(exponent, 1 - BIAS) - MANT)
        e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.maximum(e, 1 - BIAS)
        step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
        q = tl.math.div_rn(a, step)  # exact (a power of two), below 2**(MANT + 1)
        r = ((q + 8388608.0) - 8388608.0) * step  # 2**23: round half to even; r is a value of the format
        rbits = r.to(tl.uint32, bitcast=True)
        re = ((rbits >> 23) & 0xFF).to(tl.int32) - 127
        normal = ((re + BIAS) << MANT) | ((rbits >> (23 - MANT)) & ((1 << MANT) - 1)).to(tl.int32)
        sub = tl.minimum(r * SUB, 256.0).to(tl.int32)  # exact (a power of two; the bound: lanes not taken)
        codes = sign | tl.where(re >= 1 - BIAS, normal, sub)
    return codes, scale_bits
