"""The Llama family's layer stack as one compiled call (``kernels/cpu/decoder_stack.cpp``) against the
same compiled ops run layer by layer: the same logits to the bit, through prefill, decode and a mixed
step with a shared-prefix group; bound only where it computes the same thing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import CascadeGroups
from tests.compiled import cpu_backend_or_skip
from tests.workers.test_models import ARCHS, BLOCK_SIZE, NUM_BLOCKS, Checkpoint, Paging, checkpoint, load_model, max_diff
from workers.layers.kernels import bind_cpu_kernels
from workers.models import kv_cache_shape
from workers.parallel_state import TPGroup

__all__ = ["checkpoint"]  # the module-scoped checkpoint fixture
CPU = cpu_backend_or_skip()
STACKED = [name for name in ARCHS if not name.startswith("opt")]


def _model(ckpt: Checkpoint, stack: bool) -> torch.nn.Module:
    model = load_model(ckpt, TPGroup())
    bind_cpu_kernels(model, CPU.layer_ops)
    assert model.model.stack is not None
    if not stack:
        model.model.stack = None
    return model


def _run(model: torch.nn.Module, ckpt: Checkpoint) -> list[list[tuple[str, int, torch.Tensor]]]:
    num_layers, kv_heads, head_dim, _ = kv_cache_shape(ckpt.hf_config, 1)
    pools = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim) for _ in "kv") for _ in range(num_layers)]
    paging = Paging()

    def step(*chunks, groups=None):
        ids, positions, meta = paging.step(list(chunks))
        meta.backend, meta.cascade = CPU, groups
        logits = model.compute_logits(model(ids, positions, pools, meta))
        return [(seq, start, r) for (seq, start, _), r in zip(chunks, logits.split([n for *_, n in chunks]), strict=True)]

    results = [step(("A", 0, 37), ("B", 0, 13))]
    results += [step(("A", p, 1)) for p in range(37, 42)]
    paging.share_prefix("C", "A", 16)
    # A (sequence 0) and C (sequence 2) share their first two blocks: one group over them
    shared = torch.tensor([paging.tables["A"][:2]], dtype=torch.int32)
    groups = CascadeGroups(kv_starts=torch.tensor([16, 0, 16], dtype=torch.int32), block_tables=shared,
                           lens=torch.tensor([16], dtype=torch.int32), member_start=torch.tensor([0, 2], dtype=torch.int32),
                           members=torch.tensor([0, 2], dtype=torch.int32))
    results.append(step(("A", 42, 1), ("B", 13, 1), ("C", 16, 7), groups=groups))
    return results


def assert_same_bits(got_steps, want_steps, name: str) -> None:
    """Two runs of ``_run``'s scenario gave every sequence the same logits to the bit."""
    for got_step, want_step in zip(got_steps, want_steps, strict=True):
        for (seq, start, got), (_, _, want) in zip(got_step, want_step, strict=True):
            assert torch.equal(got, want), f"{name}: {seq}[{start}:] differs by {(got - want).abs().max().item():.2e}"


@pytest.mark.parametrize("name", STACKED)
def test_stack_matches_layer_by_layer_to_the_bit(name: str, checkpoint: Callable[[str], Checkpoint]) -> None:
    ckpt = checkpoint(name)
    with torch.inference_mode():
        stacked, layered = _run(_model(ckpt, True), ckpt), _run(_model(ckpt, False), ckpt)
    assert_same_bits(stacked, layered, name)
    max_diff(stacked, ckpt)  # and both match HF


def test_not_bound_where_it_would_differ(checkpoint: Callable[[str], Checkpoint], tp_ranks: Callable,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-parallel ranks (their row-parallel outputs are all-reduced between ops), architectures
    other than the Llama family, and KVSERVE_DECODER_STACK=0 keep the layer-by-layer path."""

    def bound(tp: TPGroup) -> bool:
        model = load_model(checkpoint("llama"), tp)
        bind_cpu_kernels(model, CPU.layer_ops)
        return model.model.stack is not None

    assert tp_ranks(2, bound) == [False, False]
    opt = load_model(checkpoint("opt"), TPGroup())
    bind_cpu_kernels(opt, CPU.layer_ops)
    assert not any(getattr(module, "stack", None) is not None for module in opt.modules())
    monkeypatch.setenv("KVSERVE_DECODER_STACK", "0")
    assert not bound(TPGroup())
    monkeypatch.delenv("KVSERVE_DECODER_STACK")
    assert bound(TPGroup())
