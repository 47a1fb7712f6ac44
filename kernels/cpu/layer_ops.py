"""Python faces of the compiled layer ops (``elementwise.cpp``, ``linear.cpp``), shaped like the torch
versions in ``kernels.norms``, ``kernels.rotary``, ``act_and_mul`` and ``F.linear``: a layer that was
handed a ``CpuLayerOps`` calls these instead. Each is one dispatcher call (the op overloads are
looked up once). ``DecoderStack`` runs a whole Llama-style layer stack, dense or mixture-of-experts
MLPs, in one call (``decoder_stack.cpp``)."""

from __future__ import annotations

import torch

from kernels.kv_quant import FORMAT_IDS


def lay_out_expert_weight(ops, weight: torch.Tensor, split: bool) -> tuple[torch.Tensor, bool]:
    """An expert weight [E, N, K] (float32) as the compiled experts op takes it: with ``split`` (the bf16x3
    product of ``cpu_matmul_precision="high"``) split into bfloat16 hi and lo halves where 32 divides its
    input features K, else in padded float32 column panels; and whether it was split. ``ops``: anything
    with ``moe_split_weight`` and ``moe_pack_weight`` (``CpuLayerOps``, or the loaded ops module)."""
    if split and weight.shape[2] > 0 and weight.shape[2] % 32 == 0:
        return ops.moe_split_weight(weight), True
    return ops.moe_pack_weight(weight), False


class CpuLayerOps:
    def __init__(self, ops, attention_args) -> None:
        self.ops = ops  # torch.ops.kvserve_cpu
        self.attention_args = attention_args  # PagedAttentionMetadata -> the metadata tensors the ops take
        self.linear = ops.linear.default  # F.linear; float32 batches of up to 512 rows split across threads
        # a weight packed in column panels ([N / panel, K, panel]) for the packed product of gemm.cpp
        self.pack_linear_weight = ops.pack_linear_weight.default  # (weight [N, K], out) -> None
        self.panel_width = int(ops.linear_panel_width())
        # F.linear with every output element reduced in one fixed order (batch-invariant), float32
        self.linear_fixed_order = ops.linear_fixed_order.default
        self.rms_norm = ops.rms_norm.default  # (x, weight, eps) -> normed
        self.silu_and_mul = ops.silu_and_mul.default  # [.., 2d] -> silu(gate) * up, [.., d]
        self.argmax = ops.argmax_rows.default  # float32 [rows, n] -> argmax(dim=-1), int64 [rows]
        self._fused_add_rms_norm = ops.fused_add_rms_norm.default
        self._rotary = ops.rotary_embedding.default
        self.decoder_stack = ops.decoder_stack.default
        # mixture-of-experts (moe.cpp): expert weights [E, N, K] in padded column panels, and the experts
        # of a batch grouped by expert: (x, w13, w2, topk_weights, topk_ids, expert_start, intermediate)
        self.moe_pack_weight = ops.moe_pack_weight.default
        self.moe_experts = ops.moe_experts.default
        # cpu_matmul_precision "high" where the CPU grants AMX tiles: a weight split into bfloat16 hi and
        # lo halves ([N / 32, 4, K / 2, 16] int32, N and K multiples of 32, gemm.h) for the bf16x3 product
        self.amx_usable = bool(ops.amx_usable())
        self.split_linear_weight = ops.split_linear_weight.default  # (weight [N, K], out) -> None
        # expert weights [E, N, K] split the same way ([E, Np / 32, 4, K / 2, 16] int32, N padded to Np, K a
        # multiple of 32): moe_experts takes them for w13, w2 or both, in place of packed ones
        self.moe_split_weight = ops.moe_split_weight.default

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = rms_norm(residual); returns (x, residual)."""
        self._fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotary_neox_(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, heads * d] and key [T, kv_heads * d] in place."""
        self._rotary(positions, query, key, cos_sin_cache, head_dim)
        return query, key


class DecoderStack:
    """A Llama-style decoder stack (RMSNorm, fused qkv [with per-head q/k RMSNorms] and neox rotary, paged
    attention, SiLU-gated MLP or mixture of experts) of one tensor-parallel rank of size 1 as one compiled
    call: the same ops in the same order as the layers run them one by one, without the Python between
    them.

    ``layers``: per layer ``(input_norm, qkv_weight, qkv_bias, o_weight, o_bias, post_norm,
    gate_up_weight, gate_up_bias, down_weight, down_bias)``, a bias ``None`` where there is none.
    ``qk_norms``: per layer ``(q_norm, k_norm)`` weights of size head_dim (Qwen3: each query and key
    head RMS-normalised before rotary, with ``eps``), or None.
    ``moe``: per layer ``(top_k, renormalize, intermediate)``, top_k 0 for a dense MLP, or None (all
    dense). A mixture-of-experts layer's last four weights are ``(router_weight, None, w13, w2)``: the
    router's linear weight and the experts' as ``moe_experts`` takes them (one rank holding every
    expert), run as ``workers.layers.moe.FusedMoE`` runs them.
    """

    def __init__(self, layer_ops: CpuLayerOps, layers: list[tuple], final_norm: torch.Tensor,
                 cos_sin_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float, qk_norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 moe: list[tuple[int, bool, int]] | None = None) -> None:
        none = torch.zeros(0)
        self.weights = [none if w is None else w for layer in layers for w in layer]
        self.qk_norms = [w for pair in qk_norms or () for w in pair]
        self.moe = [int(v) for layer in moe or () for v in layer]
        self.op = layer_ops.decoder_stack
        self.attention_args = layer_ops.attention_args
        self.final_norm, self.cos_sin_cache = final_norm, cos_sin_cache
        self.shape = (num_heads, num_kv_heads, head_dim, eps, scale)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        """hidden: the embedded tokens [T, hidden] (updated in place as the residual stream) -> the
        final norm's output. ``meta.deterministic`` runs the fixed-order linear and attention;
        ``meta.kv_format`` names the pools' format (a quantized pool is written and read as its codes)."""
        return self.op(hidden, positions, self.weights, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
                       self.cos_sin_cache, self.final_norm, *self.attention_args(meta), *self.shape,
                       meta.deterministic, self.qk_norms, FORMAT_IDS[meta.kv_format], self.moe)
