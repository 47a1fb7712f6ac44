"""Linear weights in the packed layout (column panels for ``gemm.cpp``) or the BLAS layout: both match
Hugging Face through the paged cache for every architecture, the layout follows ``linear_layout``'s
rules, and a weight the panels do not divide keeps the BLAS layout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.compiled import cpu_backend_or_skip
from tests.workers.test_models import ARCHS, Checkpoint, checkpoint, load_model, max_diff, run_scenario
from workers.layers.kernels import bind_cpu_kernels, linear_layout
from workers.layers.linear import ReplicatedLinear, RowParallelLinear, _ColumnShards
from workers.parallel_state import TPGroup

__all__ = ["checkpoint"]  # the module-scoped checkpoint fixture
CPU = cpu_backend_or_skip()
PANEL = CPU.layer_ops.panel_width


@pytest.mark.parametrize("layout", ["packed", "blas"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_both_layouts_match_hf(name: str, layout: str, checkpoint: Callable[[str], Checkpoint],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_LINEAR", layout)
    ckpt = checkpoint(name)
    model = load_model(ckpt, TPGroup())
    bind_cpu_kernels(model, CPU.layer_ops)
    linears = [m for m in model.modules() if isinstance(m, (ReplicatedLinear, _ColumnShards, RowParallelLinear))]
    assert linears
    for module in linears:
        out_features = module.weight.shape[0] * (module.weight.shape[2] if module.weight.dim() == 3 else 1)
        packed = layout == "packed" and out_features % PANEL == 0
        assert module.weight.dim() == (3 if packed else 2), (type(module).__name__, tuple(module.weight.shape))
        if packed:
            assert module.weight.shape[2] == PANEL and module.weight.is_contiguous()
    with torch.inference_mode():
        max_diff(run_scenario(model, ckpt.hf_config, TPGroup()), ckpt)


def test_a_weight_the_panels_do_not_divide_keeps_the_blas_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_LINEAR", "packed")
    model = torch.nn.Sequential(*(ReplicatedLinear(40, n, True, torch.float32, torch.device("cpu"))
                                  for n in (PANEL + 8, 2 * PANEL)))
    gen = torch.Generator().manual_seed(0)
    for module in model:
        module.weight.data.normal_(generator=gen)
        module.bias.data.normal_(generator=gen)
    x = torch.randn(5, 40, generator=gen)
    want = [torch.nn.functional.linear(x, m.weight, m.bias) for m in model]
    bind_cpu_kernels(model, CPU.layer_ops)
    odd, even = model
    assert odd.weight.shape == (PANEL + 8, 40) and odd.weight.stride() == (1, PANEL + 8)  # transposed [in, out]
    assert even.weight.shape == (2, 40, PANEL)
    for module, expected in zip(model, want, strict=True):
        torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


def test_a_bfloat16_weight_keeps_the_blas_layout_under_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed product is float32's: a bfloat16 model's weights (whose output features the panels
    divide) stay the transposed [in, out] matrix, and the layer's result is F.linear's."""
    monkeypatch.delenv("KVSERVE_CPU_LINEAR", raising=False)
    layer = ReplicatedLinear(64, 2 * PANEL, False, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    layer.weight.data.copy_(torch.randn(2 * PANEL, 64, generator=gen))
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), layer.weight.float())
    bind_cpu_kernels(torch.nn.Sequential(layer), CPU.layer_ops)
    assert layer.weight.shape == (2 * PANEL, 64) and layer.weight.stride() == (1, 2 * PANEL)
    assert layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x).float(), want, atol=0.1, rtol=0.02)


def test_layout_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_CPU_LINEAR", raising=False)
    assert linear_layout() == "packed"  # on every CPU (and deterministic mode's batch-invariant product)
    monkeypatch.setenv("KVSERVE_CPU_LINEAR", "blas")
    assert linear_layout() == "blas"  # under deterministic: the fixed-order linear
    monkeypatch.setenv("KVSERVE_CPU_LINEAR", "Packed ")
    assert linear_layout() == "packed"
    monkeypatch.setenv("KVSERVE_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="KVSERVE_CPU_LINEAR must be one of packed, blas, not 'fast'"):
        linear_layout()
