"""Handing a model the compiled CPU kernels once its weights are loaded.

- RMSNorm (with the residual add), SiLU-and-multiply and rotary use the backend's fused ops.
- Linear layers run the compiled linear: the packed product over column panels, or for the blas
  layout output columns split across threads, one BLAS call each (else ``F.linear``).
- A model that can run its whole layer stack as one compiled call (``bind_decoder_stack``, the
  Llama family at tensor-parallel size 1, Mixtral and Qwen3-MoE among them) does so: the same ops without the Python between them,
  about 0.1 ms per layer per step. ``KVSERVE_DECODER_STACK=0`` keeps the layer-by-layer path.
- Under ``deterministic`` every linear layer (the LM head included) runs a batch-invariant product
  instead: the packed one (whose output elements are each one chain over the inputs in order), or
  for a weight the panels do not divide (or with ``KVSERVE_CPU_LINEAR=blas``) the fixed-order
  linear, so a row's result does not depend on the batch: BLAS picks its kernel and K blocking from
  the number of rows.
- Linear weights are re-laid out in memory, in one of two layouts (``linear_layout``):
  - ``packed`` (the default): column panels (``[out / panel, in, panel]``, ``gemm.h``) for the
    compiled packed product, whose register tiles read each panel front to back. On every CPU: on a
    2-core AMD EPYC (AVX2), 64-row products of the `small` preset's shapes with weights out of cache
    ran at 88-102 GFLOP/s against 55-87 for MKL; on a 2-core Intel Xeon (Sapphire Rapids, AVX-512) a
    16-sequence decode step of the `small` preset took 15.0-15.5 ms at one thread against 22.1-22.8
    with MKL (13.6-14.6 against 16.5-17.9 at two), and a 16384-token prefill of the qwen3 `small`
    preset 3.8-4.1 s against 4.0-4.3 (2 threads).
  - ``blas``: the transpose of a contiguous ``[in, out]`` matrix: the parameter is the same
    ``[out, in]`` matrix, but ``F.linear`` then reaches BLAS without a transposed operand, which on
    CPU makes decode-sized products 35-100% faster than the ``[out, in]`` parameter (measured with
    torch 2.13 + MKL, 1 thread, M = 8-48). Taken for weights whose output features are not a
    multiple of the panel width, for weights other than float32, and where asked for.
  ``KVSERVE_CPU_LINEAR=packed`` or ``blas`` overrides the choice. The LM head tied to the embedding
  gets its own re-laid-out copy (vocab x hidden more memory), so the embedding lookup keeps reading
  contiguous rows.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn as nn

from workers.allocator import huge_empty
from workers.layers.embedding import ParallelLMHead
from workers.layers.linear import ReplicatedLinear, RowParallelLinear, _ColumnShards
from workers.layers.moe import FusedMoE

logger = logging.getLogger(__name__)
LINEAR_LAYOUTS = ("packed", "blas")


def _transposed_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same matrix, stored as its contiguous transpose (on huge pages where the kernel allows)."""
    storage = huge_empty((weight.shape[1], weight.shape[0]), weight.dtype)
    storage.copy_(weight.t())
    return storage.t()


def linear_layout() -> str:
    """``packed`` or ``blas`` (see the module docstring): ``KVSERVE_CPU_LINEAR`` if set, else packed
    (under ``deterministic`` too, where it is the batch-invariant product)."""
    chosen = os.environ.get("KVSERVE_CPU_LINEAR", "").strip().lower()
    if chosen and chosen not in LINEAR_LAYOUTS:
        raise ValueError(f"KVSERVE_CPU_LINEAR must be one of {', '.join(LINEAR_LAYOUTS)}, not {chosen!r}")
    return chosen or "packed"


def _packed_layout(weight: torch.Tensor, layer_ops) -> torch.Tensor:
    """The same matrix in column panels ``[out / panel, in, panel]`` (on huge pages where allowed)."""
    panel = layer_ops.panel_width
    storage = huge_empty((weight.shape[0] // panel, weight.shape[1], panel), weight.dtype)
    layer_ops.pack_linear_weight(weight, storage)
    return storage


def _split_layout(weight: torch.Tensor, layer_ops) -> torch.Tensor:
    """The matrix split into bfloat16 hi and lo halves for the bf16x3 product, ``[out / 32, 4, in / 2, 16]``
    int32 (``gemm.h``): the float32 matrix's bytes."""
    storage = huge_empty((weight.shape[0] // 32, 4, weight.shape[1] // 2, 16), torch.int32)
    layer_ops.split_linear_weight(weight, storage)
    return storage


def _relaid(weight: torch.Tensor, layer_ops, layout: str) -> torch.Tensor:
    if layout in ("packed", "split") and weight.dtype == torch.float32 and weight.shape[0] % layer_ops.panel_width == 0:
        # (the split takes whole blocks of 32 inputs: a layer whose input width 32 does not divide stays packed)
        if layout == "split" and weight.shape[1] % 32 == 0:
            return _split_layout(weight, layer_ops)
        return _packed_layout(weight, layer_ops)
    return _transposed_layout(weight)


def bind_layer_ops(model: nn.Module, ops, deterministic: bool = False) -> None:
    """Route ``model``'s norms, gated activations and rotary through ``ops`` (e.g. the Triton
    backend's ``fused_ops``), leaving the weights and the layer stack as they are;
    ``deterministic``: every linear layer (the LM head included) runs ``ops.linear_fixed_order``."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
        if deterministic and isinstance(module, (ReplicatedLinear, _ColumnShards, RowParallelLinear, ParallelLMHead)):
            module.linear = ops.linear_fixed_order
        if isinstance(module, FusedMoE):
            module.deterministic = deterministic


def bind_cpu_kernels(model: nn.Module, layer_ops, deterministic: bool = False, precision: str = "highest") -> str:
    """Route ``model``'s norms, gated activations and rotary through ``layer_ops`` and lay its
    linear weights out for the compiled linear (``linear_layout``). Call after the weights are
    loaded. ``deterministic``: the linear layers run batch-invariant products (the packed one, else
    the fixed-order linear). ``precision`` (``cpu_matmul_precision``): "high" splits the packed
    layout's weights, the MoE experts' among them, for the bf16x3 product where the CPU grants AMX
    tiles, except under ``deterministic`` (its products are the fixed float32 chains). Returns what
    the float32 linear layers and experts run: "bf16x3" (where any weight was split) or "float32"."""
    linear = layer_ops.linear_fixed_order if deterministic else layer_ops.linear
    layout = linear_layout()
    if layout == "packed" and precision == "high" and layer_ops.amx_usable and not deterministic:
        layout = "split"  # (weights whose output features 32 does not divide keep the transposed layout,
        # those whose input features it does not divide the packed one)
    logger.info("CPU linear layers: %s layout", layout)
    relaid, experts_split = [], False
    for module in model.modules():
        if hasattr(module, "ops"):  # RMSNorm, RotaryEmbedding, gated MLPs: they declare the slot
            module.ops = layer_ops
        if isinstance(module, FusedMoE):  # expert weights in padded column panels for moe.cpp, or split
            experts_split |= module.pack_for_cpu(layer_ops, split=layout == "split")
        if isinstance(module, (ReplicatedLinear, _ColumnShards, RowParallelLinear)):
            module.weight.data = _relaid(module.weight.data, layer_ops, layout)
            relaid.append(module.weight.data)
            module.linear = linear
        elif isinstance(module, ParallelLMHead):
            module.linear = linear
            shared = any(module.weight is m.weight for m in model.modules()
                         if m is not module and isinstance(getattr(m, "weight", None), torch.Tensor))
            if shared:
                module.packed_weight = _relaid(module.weight.data, layer_ops, layout)
                relaid.append(module.packed_weight)
            else:
                module.weight.data = _relaid(module.weight.data, layer_ops, layout)
                relaid.append(module.weight.data)
    if os.environ.get("KVSERVE_DECODER_STACK", "1") != "0":
        for module in model.modules():
            if hasattr(module, "bind_decoder_stack"):
                module.bind_decoder_stack(layer_ops)
    # bf16x3 where any weight was split (a split linear weight is 4-D; MoE experts' too): none is where 32
    # divides no layer's widths
    return "bf16x3" if experts_split or any(w.dim() == 4 for w in relaid) else "float32"
