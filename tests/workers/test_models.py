"""Llama / Mistral / Qwen2 / OPT against Hugging Face transformers on tiny random checkpoints, run
through the paged KV cache (prefill, decode, mixed steps with a cached prefix), at tp = 1 and with
simulated tensor parallelism (threads, see conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from kernels import PagedAttentionMetadata
from workers.models import kv_cache_shape, resolve_architecture, sliding_window
from workers.models.llama import LlamaForCausalLM
from workers.models.opt import OPTForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.parallel_state import TPGroup
from workers.weight_loader import TensorSlice, WeightSlice, iter_checkpoint

VOCAB, BLOCK_SIZE, NUM_BLOCKS = 300, 8, 32
TOL = 1e-4
_GATED = dict(num_key_value_heads=2, intermediate_size=128, initializer_range=0.1)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", dict(_GATED, attention_bias=True, mlp_bias=True)),
    "llama3": ("Llama", dict(_GATED, head_dim=24, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("Mistral", dict(_GATED, num_key_value_heads=1, head_dim=32, sliding_window=4096,
                                rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "qwen2": ("Qwen2", dict(_GATED, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16))),
    "opt": ("OPT", dict(ffn_dim=128, init_std=0.1)),
    "opt_post_ln": ("OPT", dict(ffn_dim=128, init_std=0.1, do_layer_norm_before=False, word_embed_proj_dim=32)),
}

_gen = torch.Generator().manual_seed(1234)
A = torch.randint(VOCAB, (43,), generator=_gen).tolist()  # 37-token prompt, 5 decodes, 1 decode in the mixed step
B = torch.randint(VOCAB, (14,), generator=_gen).tolist()  # 13-token prompt, 1 decode in the mixed step
C = A[:16] + torch.randint(VOCAB, (7,), generator=_gen).tolist()  # shares A's first two blocks
SEQS = {"A": A, "B": B, "C": C}


@dataclass
class Checkpoint:
    path: Path
    hf_config: dict[str, Any]
    hf_model: transformers.PreTrainedModel
    ref_logits: dict[str, torch.Tensor]  # HF logits over each whole sequence of SEQS


def _build(name: str, path: Path) -> Checkpoint:
    family, kwargs = ARCHS[name]
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=128, attn_implementation="eager", **kwargs,
    )
    torch.manual_seed(0)
    return saved_checkpoint(getattr(transformers, f"{family}ForCausalLM")(config).eval(), path)


def saved_checkpoint(hf_model: transformers.PreTrainedModel, path: Path) -> Checkpoint:
    """``hf_model`` saved at ``path``, with its logits over each sequence of SEQS (the reference)."""
    hf_model.save_pretrained(path)
    with torch.inference_mode():
        refs = {seq: hf_model(torch.tensor([tokens])).logits[0].float() for seq, tokens in SEQS.items()}
    return Checkpoint(path, json.loads((path / "config.json").read_text()), hf_model, refs)


def cached_builds(tmp_path_factory: pytest.TempPathFactory,
                  build: Callable[[str, Path], Checkpoint]) -> Callable[[str], Checkpoint]:
    """name -> ``build(name, a new temporary directory)``, built once per name (a module fixture's body)."""
    cache: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            cache[name] = build(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    return cached_builds(tmp_path_factory, _build)


class Paging:
    """Block tables of a few sequences over shuffled block ids (block 0 is the null block)."""

    def __init__(self, seed: int = 0) -> None:
        self.free = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        self.tables: dict[str, list[int]] = {}

    def share_prefix(self, dst: str, src: str, num_tokens: int) -> None:
        """``dst`` starts with the (full) blocks holding ``src``'s first ``num_tokens`` tokens."""
        assert num_tokens % BLOCK_SIZE == 0
        self.tables[dst] = self.tables[src][: num_tokens // BLOCK_SIZE]

    def step(self, chunks: list[tuple[str, int, int]]) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """Inputs of one step computing tokens [start, start + n) of each (seq, start, n), decodes first."""
        ids, positions = [], []
        for seq, start, n in chunks:
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free.pop())
            ids += SEQS[seq][start : start + n]
            positions += range(start, start + n)
        meta = PagedAttentionMetadata.build([n for *_, n in chunks], [start + n for _, start, n in chunks],
                                            [self.tables[seq] for seq, _, _ in chunks], BLOCK_SIZE)
        return torch.tensor(ids), torch.tensor(positions), meta


StepResult = list[tuple[str, int, torch.Tensor | None]]  # (seq, start, logits of its n tokens)


def run_scenario(
    model: torch.nn.Module, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype = torch.float32
) -> list[StepResult]:
    """Prefill A (37 tokens) and B (13) together, decode A five times, then one mixed step: decode A,
    decode B, and prefill C after the 16-token prefix it shares with A (cached blocks)."""
    num_layers, kv_heads, head_dim, _ = kv_cache_shape(hf_config, tp.size)
    pools = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype) for _ in "kv")
             for _ in range(num_layers)]
    paging = Paging()

    def step(*chunks: tuple[str, int, int]) -> StepResult:
        ids, positions, meta = paging.step(list(chunks))
        logits = model.compute_logits(model(ids, positions, pools, meta))
        if logits is None:
            return [(seq, start, None) for seq, start, _ in chunks]
        rows = logits.split([n for *_, n in chunks])
        return [(seq, start, r) for (seq, start, _), r in zip(chunks, rows, strict=True)]

    results = [step(("A", 0, 37), ("B", 0, 13))]
    results += [step(("A", p, 1)) for p in range(37, 42)]
    paging.share_prefix("C", "A", 16)
    results.append(step(("A", 42, 1), ("B", 13, 1), ("C", 16, 7)))
    return results


def max_diff(results: list[StepResult], ckpt: Checkpoint) -> float:
    worst = 0.0
    for step_no, result in enumerate(results):
        for seq, start, logits in result:
            ref = ckpt.ref_logits[seq][start : start + len(logits)]
            diff = (logits - ref).abs().max().item()
            assert diff < TOL, f"step {step_no}: {seq}[{start}:{start + len(logits)}] differs from HF by {diff:.2e}"
            worst = max(worst, diff)
    return worst


def load_model(ckpt: Checkpoint, tp: TPGroup, weights: Iterator[tuple[str, WeightSlice]] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = resolve_architecture(ckpt.hf_config)(ckpt.hf_config, tp, dtype, torch.device("cpu"))
    model.load_weights(iter_checkpoint(ckpt.path) if weights is None else weights)
    return model


@pytest.mark.parametrize("name", list(ARCHS))
def test_matches_hf_through_paged_cache(name: str, checkpoint: Callable[[str], Checkpoint]) -> None:
    ckpt = checkpoint(name)
    with torch.inference_mode():
        results = run_scenario(load_model(ckpt, TPGroup()), ckpt.hf_config, TPGroup())
    print(f"{name}: max |logits - HF| = {max_diff(results, ckpt):.2e}")


@pytest.mark.parametrize(
    "name,tp_size",
    [("llama", 2), ("llama", 4), ("llama3", 2), ("mistral", 2), ("qwen2", 4), ("opt", 2), ("opt_post_ln", 4)],
)
def test_tensor_parallel_matches_hf(
    name: str, tp_size: int, checkpoint: Callable[[str], Checkpoint], tp_ranks: Callable
) -> None:
    """Every rank loads its slices of the checkpoint; rank 0's logits match HF, the others get None."""
    ckpt = checkpoint(name)
    per_rank = tp_ranks(tp_size, lambda tp: run_scenario(load_model(ckpt, tp), ckpt.hf_config, tp))
    print(f"{name} tp={tp_size}: max |logits - HF| = {max_diff(per_rank[0], ckpt):.2e}")
    assert all(logits is None for results in per_rank[1:] for step in results for *_, logits in step)


@pytest.mark.parametrize("name", ["llama", "qwen2", "opt_post_ln"])
def test_sharded_checkpoint(name: str, checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    ckpt = checkpoint(name)
    ckpt.hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    with torch.inference_mode():
        model = load_model(ckpt, TPGroup(), iter_checkpoint(tmp_path))
        max_diff(run_scenario(model, ckpt.hf_config, TPGroup()), ckpt)


def test_opt_names_without_model_prefix_and_saved_lm_head(checkpoint: Callable[[str], Checkpoint]) -> None:
    """Original OPT checkpoints name tensors ``decoder.*`` and some carry the tied ``lm_head.weight``."""
    ckpt = checkpoint("opt")
    weights = [(name.removeprefix("model."), w) for name, w in iter_checkpoint(ckpt.path)]
    embed = dict(weights)["decoder.embed_tokens.weight"][:]
    with torch.inference_mode():
        model = load_model(ckpt, TPGroup(), iter([*weights, ("lm_head.weight", TensorSlice(embed))]))
        max_diff(run_scenario(model, ckpt.hf_config, TPGroup()), ckpt)


def test_bfloat16_close_to_hf(checkpoint: Callable[[str], Checkpoint]) -> None:
    ckpt = checkpoint("llama")
    with torch.inference_mode():
        model = load_model(ckpt, TPGroup(), dtype=torch.bfloat16)
        (_, _, logits), _ = run_scenario(model, ckpt.hf_config, TPGroup(), torch.bfloat16)[0]
    ref = ckpt.ref_logits["A"][:37]
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def _weights(ckpt: Checkpoint) -> dict[str, WeightSlice]:
    return dict(iter_checkpoint(ckpt.path))


def _load_error(ckpt: Checkpoint, weights: dict[str, WeightSlice]) -> str:
    model = resolve_architecture(ckpt.hf_config)(ckpt.hf_config, TPGroup(), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError) as excinfo:
        model.load_weights(weights.items())
    return str(excinfo.value)


def test_missing_and_unexpected_weights_are_named(checkpoint: Callable[[str], Checkpoint]) -> None:
    ckpt = checkpoint("llama")
    weights = _weights(ckpt)
    del weights["model.layers.1.self_attn.k_proj.weight"], weights["model.norm.weight"]
    weights["model.layers.0.mlp.extra_proj.weight"] = TensorSlice(torch.zeros(2, 2))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = TensorSlice(torch.zeros(8))  # known buffer: skipped
    message = _load_error(ckpt, weights)
    assert "unexpected tensors: model.layers.0.mlp.extra_proj.weight;" in message
    assert "model.layers.1.self_attn.qkv_proj.weight['k']" in message and "model.norm.weight" in message
    assert "qkv_proj.bias" not in message and "inv_freq" not in message


def test_wrong_shape_is_named(checkpoint: Callable[[str], Checkpoint]) -> None:
    ckpt = checkpoint("llama")
    weights = _weights(ckpt)
    weights["model.layers.0.mlp.up_proj.weight"] = TensorSlice(torch.zeros(100, 64))
    message = _load_error(ckpt, weights)
    assert "'model.layers.0.mlp.up_proj.weight'" in message and "(100, 64)" in message


def test_tied_lm_head_is_ignored_but_untied_one_is_required(checkpoint: Callable[[str], Checkpoint]) -> None:
    tied, untied = checkpoint("qwen2"), checkpoint("llama")
    weights = _weights(tied)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model = Qwen2ForCausalLM(tied.hf_config, TPGroup(), torch.float32, torch.device("cpu"))
    model.load_weights(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = _weights(untied)
    del weights["lm_head.weight"]
    assert "missing parameters: lm_head.weight" in _load_error(untied, weights)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no safetensors checkpoint.*pytorch_model\.bin"):
        list(iter_checkpoint(tmp_path))


def test_registry(checkpoint: Callable[[str], Checkpoint]) -> None:
    expected = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM,
                "opt": OPTForCausalLM}
    for name, cls in expected.items():
        assert resolve_architecture(checkpoint(name).hf_config) is cls
    with pytest.raises(ValueError, match=r"unsupported model architecture.*GPT2LMHeadModel.*supported: Llama"):
        resolve_architecture({"architectures": ["GPT2LMHeadModel"]})
    llama, mistral, opt = (checkpoint(n).hf_config for n in ("llama", "mistral", "opt"))
    assert [kv_cache_shape(llama, tp) for tp in (1, 2, 4)] == [(2, 2, 16, False), (2, 1, 16, False), (2, 1, 16, True)]
    assert kv_cache_shape(mistral, 2) == (2, 1, 32, True)
    assert kv_cache_shape(opt, 2) == (2, 2, 16, False)
    assert sliding_window(mistral) == 4096
    assert sliding_window(checkpoint("qwen2").hf_config) is None
    assert sliding_window({**checkpoint("qwen2").hf_config, "layer_types": ["full_attention", "sliding_attention"],
                           "sliding_window": 64}) == 64
    assert sliding_window(llama) is None and sliding_window(opt) is None
