"""Checkpoint reading: lazy safetensors slices, routed by name to each parameter's ``weight_loader``.

A rank never materialises a full tensor it only holds part of: the checkpoint yields lazy slices
(``weight[a:b]``, ``weight[:, a:b]``, ``weight.get_shape()``) and each parameter's loader reads the
rows or columns of its own rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn
from safetensors import safe_open

from workers.model_source import checkpoint_files

ShardId = str | int | None
# (fused parameter part, checkpoint part, shard id), e.g. ("qkv_proj", "k_proj", "k")
StackedParam = tuple[str, str, ShardId]

# Buffers some checkpoints carry that are recomputed here, never loaded.
_NON_PARAMETERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightSlice(Protocol):
    """A lazily read checkpoint tensor: indexing reads only the selected part."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...

    def get_shape(self) -> list[int]: ...


class TensorSlice:
    """An in-memory tensor behind the ``WeightSlice`` interface (tests, tied or derived weights)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, WeightSlice]]:
    """Every (name, lazy slice) of the checkpoint in ``model_dir``; nothing is read until sliced."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` with an exact shape check (casting dtype and device as needed)."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint gives shape {tuple(src.shape)} where {tuple(dst.shape)} is expected")
    dst.copy_(src)


class WeakLoader:
    """A layer's loader method, held weakly: ``param.weight_loader = layer.weight_loader`` would make a
    reference cycle (parameter -> bound method -> layer -> parameter), which only the cyclic collector
    frees, and the engine freezes what start-up made out of its sight (``gc.freeze``): the weights of
    an engine shut down (or of ranks rebuilt in its process) would never be freed."""

    __slots__ = ("_method",)

    def __init__(self, method) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
        method = self._method()
        if method is None:
            raise RuntimeError("the layer that loads this parameter is gone")
        method(param, weight, shard_id)


def default_weight_loader(param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
    """Loader of a replicated, unfused parameter: the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"unfused parameter got shard {shard_id!r}")
    copy_weight(param.data, weight[:])


def _route(name: str, stacked_params: Iterable[StackedParam]) -> tuple[str, ShardId]:
    for fused, part, shard_id in stacked_params:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def _listing(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_into(
    model: nn.Module,
    weights: Iterable[tuple[str, WeightSlice]],
    stacked_params: tuple[StackedParam, ...] = (),
    ignore: tuple[str, ...] = (),
    route: Callable[[str], tuple[str, ShardId] | None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Load every checkpoint tensor into its parameter via ``param.weight_loader(param, slice, shard_id)``.

    ``route(name)``, where given, names the (parameter, shard id) of a checkpoint tensor first (None:
    not one of its). Checkpoint names containing ``.{part}.`` of a ``stacked_params`` entry go to the
    fused parameter with that shard id. Names ending in an ``ignore`` suffix (or a known buffer) are
    skipped. A parameter's ``shard_ids`` attribute, where it has one, is the set of shard ids it must
    be given (others routed to it are its loader's to skip). Names ``skip`` answers True for are
    another pipeline stage's: not read. Raises ValueError naming every
    unexpected checkpoint tensor and every parameter (or shard) left unloaded.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[ShardId]] = {}
    unexpected: list[str] = []
    for ckpt_name, weight in weights:
        if ckpt_name.endswith(_NON_PARAMETERS + ignore) or (skip is not None and skip(ckpt_name)):
            continue
        routed = route(ckpt_name) if route is not None else None
        name, shard_id = routed if routed is not None else _route(ckpt_name, stacked_params)
        param = params.get(name)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, weight, shard_id)
        except (ValueError, KeyError) as e:
            raise ValueError(f"cannot load checkpoint tensor {ckpt_name!r} into {name!r}: {e}") from e
        loaded.setdefault(name, set()).add(shard_id)
    missing = []
    for name, param in params.items():
        expected = getattr(param, "shard_ids", None) or \
            {sid for fused, _, sid in stacked_params if f".{fused}." in f".{name}"} or {None}
        missing += [name if sid is None else f"{name}[{sid!r}]" for sid in expected - loaded.get(name, set())]
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: unexpected tensors: {_listing(unexpected)}; "
            f"missing parameters: {_listing(missing)}"
        )
