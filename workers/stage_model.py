"""A rank's model: its architecture's class for this stage of the layers (``build_stage_model``), and
how the stage's layers reach the KV pool (``bind_window_tables``, ``stage_layer_caches``).

The KV pool follows the configuration's ``KVLayout`` (``engine.kv_layout``): ``page_layers`` tensor
pairs (``kv_pool``; one per layer for a plain layout), under pipeline parallelism only those the
stage's layers use (``KVLayout.pool_pairs``: block ids and window tables are the whole model's). A
runner's ``kv_caches`` stays one pair per (stage) layer, layer l's being pool pair ``placement(l)[0]``
(a hybrid layout's pairs are shared by a full layer and window layers), so the models' forward is the
same for both; each ``Attention`` module is told its table (``placement(l)[1]``) once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from workers.layers.attention import Attention
from workers.models.registry import resolve_architecture
from workers.parallel_state import PipelineStage, TPGroup
from workers.weight_loader import iter_checkpoint

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]


def build_stage_model(config: EngineConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                      stage: PipelineStage) -> nn.Module:
    """The model's shard for this rank and stage, its weights loaded (in eval mode); a ValueError for
    what the architecture cannot do (expert parallelism, pipeline stages, LongRoPE)."""
    hf_config = config.model.hf_config
    model_cls = resolve_architecture(hf_config)
    if config.parallel.enable_expert_parallel and not getattr(model_cls, "supports_expert_parallel", False):
        raise ValueError(f"enable_expert_parallel is not supported for {model_cls.__name__}")
    extra = {"expert_parallel": True} if config.parallel.enable_expert_parallel else {}
    if stage.size > 1:
        if not getattr(model_cls, "supports_pipeline_parallel", False):
            raise ValueError(f"pipeline parallelism is not supported for {model_cls.__name__}")
        extra["stage"] = stage
    model = model_cls(hf_config, tp, dtype, device, **extra)
    if config.model.long_rope_threshold is not None and getattr(model, "long_rope", None) is None:
        raise ValueError(f"{config.model.architecture} cannot serve LongRoPE: it has no long-prompt position "
                         "offsets, so long prompts would be rotated with the short factors")
    model.load_weights(iter_checkpoint(config.model.path))
    model.eval()
    return model


def bind_window_tables(model: nn.Module, layout: KVLayout, stage: PipelineStage) -> None:
    """Tell each Attention module (in layer order: this stage's layers) which table its layer reads."""
    if not layout.hybrid:
        return
    modules = [m for m in model.modules() if isinstance(m, Attention)]
    layers = range(stage.start, stage.end)
    if len(modules) != len(layers):
        raise ValueError(f"a hybrid KV layout needs one Attention module per layer: {len(modules)} for "
                         f"{len(layers)} layers")
    for layer, module in zip(layers, modules):
        if (module.window > 0) != (layer in layout.window_layers):
            raise ValueError(f"layer {layer}'s attention window ({module.window}) disagrees with the KV layout")
        module.table = layout.placement(layer)[1]


def stage_layer_caches(layout: KVLayout, stage: PipelineStage, pool_pairs: tuple[int, ...], pool: KVPairs) -> KVPairs:
    """The per-layer view (this stage's layers) of a pool's tensor pairs (``KVLayout.placement``, the
    pairs numbered as ``pool_pairs`` orders them)."""
    index = {pair: i for i, pair in enumerate(pool_pairs)}
    return [pool[index[layout.placement(layer)[0]]] for layer in range(stage.start, stage.end)]
