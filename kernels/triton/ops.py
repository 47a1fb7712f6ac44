"""Triton kernels: paged attention for a whole mixed step (split-KV with a log-sum-exp reduce), the
KV store by slot mapping; RMSNorm with and without the residual add, SiLU-and-multiply and neox
rotary in place (``kernels.triton.layer_kernels``, re-exported here).

Importing this module imports Triton and decorates the kernels: ``TRITON_INTERPRET=1`` must be set
before that for them to run on CPU tensors under the interpreter (``INTERPRETED`` records which).

Attention reads K/V through the block table inside the kernel (no gather). A program owns one
key/value head and a tile of query rows: ``BLOCK_Q`` query tokens of one sequence times the
``GROUP`` query heads that share the KV head (padded to a power of two), so grouped-query heads
read each key tile once. Keys are walked in tiles of ``BLOCK_N`` positions; each position finds its
block through the table (``position // BLOCK_SIZE``, a compile-time constant: one compilation per
pool's block size), so any block size works, powers of two or not. With ``NUM_SPLITS > 1`` the key
range of a tile is cut into that many contiguous parts, each its own program (flash-decoding): they
write unnormalised partial outputs with their running max and sum, and a reduce kernel merges them
by log-sum-exp.

Sliding window and soft-capping (Gemma 2/3) are runtime arguments, not constexprs, so they add no
variant: ``window`` > 0 hides from the query at position p the keys at positions <= p - window (a tile
starts at the key tile holding its first query's lowest visible key; skipped tiles would add exact
zeros, so deterministic mode keeps its bits; the keys below the first query's window in that tile are
not loaded, since a hybrid KV layout's window table may name a stale page there), and ``softcap`` > 0 maps each scaled score s to
softcap * tanh(s / softcap) (tanh through exp(-2|x|), which cannot overflow) before the mask.

Quantized pools (``kv_cache_dtype``, ``kernels.kv_quant``: uint8 rows of ``head_dim`` codes and a bfloat16
scale) are the constexpr ``KV_FORMAT`` (format 0, the model's dtype, compiles as before): the store
quantizes each (token, head) row in the kernel to exactly ``kernels.kv_quant.quantize``'s bytes, and the
attention loads each key/value tile's codes and scales from the pool in place (no dequantized copy),
dequantizes them in registers to float32 (a code times its scale: exact), and goes on as for format 0 —
tl.dot on them in the query's dtype (a no-op for float32), the sums path in float32. The new tokens of
the step are read back from the pool like the rest, so every key and value is the stored value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# every launch goes through ``_launch`` (the warm-up's hooks see it); re-exported here
from kernels.triton.kv_quant import check_pool, load_quantized, quantize_rows
from kernels.triton.launch import INTERPRETED, LAUNCH_HOOKS, _launch, _p2  # noqa: F401

_LOG2E = 1.4426950408889634

# Triton compiles one variant per distinct specialisation of a kernel's arguments: every integer
# equal to 1 or divisible by 16, and every pointer's 16-byte alignment, is part of the variant. The
# values that change from step to step (the block table's width, a launch's first token) and the
# arguments that come from views of the model's tensors (strides of the fused qkv output, the
# step's inputs at any offset of one staging buffer) are not specialised, so that the variants an
# engine launches are fixed by its configuration alone (``kernels.triton.warmup`` compiles them all
# at start). The pool's, the output's and the norms' strides stay specialised: they are fixed by
# the configuration, and their divisibility lets the compiler vectorise the loads.
_ATTENTION_DNS = ["stride_qt", "stride_qh", "stride_bt", "token_begin", "window"]
_ATTENTION_DNA = ["q_ptr", "tile_seq_ptr", "tile_q_ptr", "query_start_ptr", "seq_lens_ptr", "block_tables_ptr"]



@triton.jit(do_not_specialize=_ATTENTION_DNS, do_not_specialize_on_alignment=_ATTENTION_DNA)
def _paged_attention_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, out_ptr, part_ptr, part_m_ptr, part_l_ptr,
    tile_seq_ptr, tile_q_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    sm_scale_log2, cap_in, cap_out, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    num_heads, token_begin,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr, KV_FORMAT: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    split64 = split.to(tl.int64)  # offsets into the partial outputs can pass 2**31
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2

    seq = tl.load(tile_seq_ptr + tile)
    q_off = tl.load(tile_q_ptr + tile)  # first query token of the tile, within the sequence
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # the sequence's i-th query token sits at prefix + i

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_off + rows // GROUP_P2  # query token within the sequence
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_idx < q_len) & (rows % GROUP_P2 < GROUP)
    q_pos = prefix + q_idx  # its position: it sees keys 0..q_pos
    dims = tl.arange(0, HEAD_P2)
    dim_ok = dims < HEAD_DIM

    token = (q_begin + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # keys this tile needs: up to the last query's position (causal), from the first query's window,
    # split in NUM_SPLITS parts
    last_q = tl.minimum(q_off + BLOCK_Q, q_len) - 1
    kv_end = prefix + last_q + 1
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    lowest = tl.where(window > 0, tl.maximum(prefix + q_off + 1 - window, 0), 0)  # the first query's lowest key
    first_tile = lowest // BLOCK_N
    per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    start_tile = first_tile + split * per_split
    below = tl.where(window > 0, q_pos - window, -1)  # each row sees the keys past it
    end_tile = tl.minimum(start_tile + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(start_tile, end_tile):
        pos = t * BLOCK_N + offs_n
        # keys below every row's window are not loaded (a hybrid layout's window table may name a stale
        # page there: NaN times a zero weight would still be NaN)
        pos_ok = (pos < kv_end) & (pos >= lowest)
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        within = (pos % BLOCK_SIZE).to(tl.int64)
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        if KV_FORMAT == 0:  # the pool holds the model's dtype
            k = tl.load(k_pool_ptr + block[:, None] * stride_kb + within[:, None] * stride_ks + kv_head * stride_kh
                        + dims[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_pool_ptr + block[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                        + dims[None, :], mask=kv_ok, other=0.0)
        else:  # the stored codes and scales read in place, dequantized in registers to float32 (``kv_quant.load_quantized``);
            # tl.dot takes them in the query's dtype (a no-op for float32), the sums path keeps float32
            k_row = k_pool_ptr + block * stride_kb + within * stride_ks + kv_head * stride_kh  # [BLOCK_N] row starts
            v_row = v_pool_ptr + block * stride_vb + within * stride_vs + kv_head * stride_vh
            k = load_quantized(k_row, dims, kv_ok, pos_ok, HEAD_DIM, KV_FORMAT)
            v = load_quantized(v_row, dims, kv_ok, pos_ok, HEAD_DIM, KV_FORMAT)
            if USE_DOT:
                k = k.to(q_ptr.dtype.element_ty)
                v = v.to(q_ptr.dtype.element_ty)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        else:  # (see paged_attention_launch's use_dot)
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        if cap_out > 0:  # softcap * tanh(s * scale / softcap), in log2 units
            capped = s * cap_in
            decay = tl.exp(-2.0 * tl.abs(capped))
            tanh = (1.0 - decay) / (1.0 + decay)
            s = tl.where(capped < 0, -tanh, tanh) * cap_out
        else:
            s = s * sm_scale_log2  # log2 units
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > below[:, None]) & pos_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the scratch, [launch token, split, head(, HEAD_P2)] from the launch's first token
        part_row = ((token - token_begin) * NUM_SPLITS + split64) * num_heads + head
        tl.store(part_ptr + part_row[:, None] * HEAD_P2 + dims[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_l_ptr + part_row, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["token_begin"])
def _merge_splits_kernel(
    out_ptr, part_ptr, part_m_ptr, part_l_ptr, token_begin, stride_ot, stride_oh, num_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # the launch's row-th token
    token = token_begin + row
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2).to(tl.int64)
    ok = splits < NUM_SPLITS
    part_row = (row * NUM_SPLITS + splits) * num_heads + head
    m = tl.load(part_m_ptr + part_row, mask=ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part_row, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # empty splits weigh nothing
    dims = tl.arange(0, HEAD_P2)
    acc = tl.load(part_ptr + part_row[:, None] * HEAD_P2 + dims[None, :],
                  mask=ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_kt", "stride_kh", "stride_vt", "stride_vh"],
            do_not_specialize_on_alignment=["key_ptr", "value_ptr", "slot_ptr"])
def _store_kv_kernel(
    key_ptr, value_ptr, k_pool_ptr, v_pool_ptr, slot_ptr, block_size, kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_pkb, stride_pks, stride_pkh, stride_pvb, stride_pvs, stride_pvh,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, HEADS_P2: tl.constexpr, KV_FORMAT: tl.constexpr = 0,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = tl.maximum(slot, 0) // block_size
    within = tl.maximum(slot, 0) % block_size
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, HEAD_P2)
    slots = tl.zeros([HEADS_P2, HEAD_P2], tl.int64) + slot  # a tensor: the interpreter cannot mask by a scalar
    mask = (heads[:, None] < kv_heads) & (dims[None, :] < HEAD_DIM) & (slots >= 0)
    if KV_FORMAT == 0:
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(k_pool_ptr + block * stride_pkb + within * stride_pks + heads[:, None] * stride_pkh + dims[None, :],
                 k, mask=mask)
        tl.store(v_pool_ptr + block * stride_pvb + within * stride_pvs + heads[:, None] * stride_pvh + dims[None, :],
                 v, mask=mask)
    else:  # each (token, head) row quantized to its codes and bfloat16 scale (``kv_quant.quantize_rows``)
        row_mask = (heads < kv_heads) & ((tl.zeros([HEADS_P2], tl.int64) + slot) >= 0)
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
        k_codes, k_scale = quantize_rows(k.to(tl.float32), KV_FORMAT)
        v_codes, v_scale = quantize_rows(v.to(tl.float32), KV_FORMAT)
        k_row = k_pool_ptr + block * stride_pkb + within * stride_pks + heads * stride_pkh  # [HEADS_P2]
        v_row = v_pool_ptr + block * stride_pvb + within * stride_pvs + heads * stride_pvh
        tl.store(k_row[:, None] + dims[None, :], k_codes.to(tl.uint8), mask=mask)
        tl.store(v_row[:, None] + dims[None, :], v_codes.to(tl.uint8), mask=mask)
        tl.store(k_row + HEAD_DIM, (k_scale & 0xFF).to(tl.uint8), mask=row_mask)  # the scale, low byte first
        tl.store(k_row + (HEAD_DIM + 1), (k_scale >> 8).to(tl.uint8), mask=row_mask)
        tl.store(v_row + HEAD_DIM, (v_scale & 0xFF).to(tl.uint8), mask=row_mask)
        tl.store(v_row + (HEAD_DIM + 1), (v_scale >> 8).to(tl.uint8), mask=row_mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor, kv_format: int = 0) -> None:
    """Write ``key``/``value`` ([tokens, kv_heads, d], contiguous last axis, any other strides) into
    their slots of the pools ([blocks, block_size, kv_heads, d], contiguous); slots < 0 are skipped.
    ``kv_format`` > 0 (``kernels.kv_quant.FORMAT_IDS``): uint8 pools of ``d + 2`` bytes per row, each row
    quantized as ``kernels.kv_quant.quantize`` does, to the byte."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, kv_heads, width = k_pool.shape
    head_dim = key.shape[-1]
    _check_last_axis(key=key, value=value, k_pool=k_pool, v_pool=v_pool)
    check_pool("triton store_kv", k_pool, head_dim, kv_format)
    constexprs = dict(HEAD_DIM=head_dim, HEAD_P2=_p2(head_dim), HEADS_P2=_p2(kv_heads))
    if kv_format:
        constexprs["KV_FORMAT"] = kv_format
    _launch(_store_kv_kernel, (num_tokens,), (
        key, value, k_pool, v_pool, slot_mapping, block_size, kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3],
    ), constexprs)


def _check_last_axis(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention: {name} needs a contiguous last axis (strides {tuple(t.stride())})")


class SplitScratch:
    """The split-KV partial results of one launch: ``rows`` (launch token, split) pairs of every
    query head, float32 (the partial outputs padded to ``head_p2``, their running max and sum). One
    is allocated by the attention backend and reused by every launch (``TritonAttentionBackend``)."""

    def __init__(self, rows: int, num_heads: int, head_dim: int, device: torch.device | str) -> None:
        self.rows, self.num_heads, self.head_p2 = rows, num_heads, _p2(head_dim, 16)
        self.part = torch.empty(rows * num_heads * self.head_p2, dtype=torch.float32, device=device)
        self.part_m = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        self.part_l = torch.empty(rows * num_heads, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.part.nbytes + self.part_m.nbytes + self.part_l.nbytes

    def fits(self, num_heads: int, head_dim: int, device: torch.device) -> bool:
        return (num_heads, _p2(head_dim, 16)) == (self.num_heads, self.head_p2) and self.part.device == device


def paged_attention_launch(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    tile_seq: torch.Tensor, tile_q: torch.Tensor, token_begin: int, num_tokens: int,
    scale: float, block_q: int, block_n: int, num_splits: int, use_dot: bool = True,
    scratch: SplitScratch | None = None, window: int = 0, softcap: float = 0.0, kv_format: int = 0,
) -> None:
    """Attend the tiles (``tile_seq``, ``tile_q``) of one launch, writing ``out`` rows
    [token_begin, token_begin + num_tokens); ``num_splits`` > 1 splits each tile's keys and merges
    through ``scratch`` (which must hold ``num_splits * num_tokens`` rows; unused, and may be None,
    without splits). ``use_dot=False`` takes the products as multiplies and sums
    instead of ``tl.dot``: under the interpreter ``tl.dot`` is numpy's BLAS, whose result for a query
    row depends on the row's place in the tile, which batch-invariant attention (``deterministic``)
    cannot have (and which misreads bfloat16, so bfloat16 takes the sums there too). ``window`` and
    ``softcap``: see the module's docstring (0: none). ``kv_format`` > 0 (``kernels.kv_quant.FORMAT_IDS``):
    the pools are uint8, ``head_dim + 2`` bytes a row, read in place and dequantized in the kernel."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_pool.shape[2]
    group = num_heads // kv_heads
    head_p2 = _p2(head_dim, 16)  # tl.dot takes operands of 16 or more along every axis
    _check_last_axis(query=query, k_pool=k_pool, v_pool=v_pool, out=out)
    check_pool("triton attention", k_pool, head_dim, kv_format)
    if num_splits > 1:
        if scratch is None or scratch.rows < num_splits * num_tokens or not scratch.fits(num_heads, head_dim, out.device):
            have = f"{scratch.rows} rows x {scratch.num_heads} heads x {scratch.head_p2}" if scratch else "none"
            raise ValueError(f"split-KV scratch of {have} for {num_splits} splits of {num_tokens} tokens x "
                             f"{num_heads} heads x {head_dim}")
        part, part_m, part_l = scratch.part, scratch.part_m, scratch.part_l
    else:
        part = part_m = part_l = out  # unused
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    if INTERPRETED and query.dtype == torch.bfloat16:
        use_dot = False  # the interpreter's tl.dot misreads bfloat16 operands (numpy has none); the sums do not
    grid = (tile_seq.numel(), kv_heads, num_splits)
    _launch(_paged_attention_kernel, grid, (
        query, k_pool, v_pool, out, part, part_m, part_l,
        tile_seq, tile_q, query_start_loc, seq_lens, block_tables,
        scale * _LOG2E, scale / softcap if softcap > 0 else 0.0, softcap * _LOG2E if softcap > 0 else 0.0,
        int(window),
        query.stride(0), query.stride(1), *k_pool.stride()[:3], *v_pool.stride()[:3],
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        num_heads, token_begin,
    ), dict(
        BLOCK_SIZE=k_pool.shape[1], HEAD_DIM=head_dim, HEAD_P2=head_p2, GROUP=group, GROUP_P2=_p2(group),
        BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=num_splits, DOT_PRECISION=precision, USE_DOT=use_dot,
        **({"KV_FORMAT": kv_format} if kv_format else {}),
    ))
    if num_splits > 1:
        _launch(_merge_splits_kernel, (num_tokens, num_heads), (
            out, part, part_m, part_l, token_begin, out.stride(0), out.stride(1), num_heads,
        ), dict(NUM_SPLITS=num_splits, SPLITS_P2=_p2(num_splits), HEAD_DIM=head_dim, HEAD_P2=head_p2))


# the layers' ops live beside (``kernels.triton.layer_kernels``)
from kernels.triton.layer_kernels import fused_add_rms_norm, rms_norm, rotary_neox_, silu_and_mul  # noqa: E402,F401
