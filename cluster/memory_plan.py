"""The host memory each rank of an engine holds, reserved as Ray's ``memory`` resource in its
placement-group bundle, so that Ray puts a rank only on a node that can hold it: a model whose weights
exceed one node's memory is placed a pipeline stage per node, and one that no split fits is refused
before start with a sentence naming the rank's needs and the largest node.

A rank's need on a CPU device: its share of the weights (its stage's layers, the embedding on the first
stage, the final norm and LM head on the last, the embedding again there where the LM head is tied to
it; all divided by the tensor-parallel size), its KV pool (``kv_cache_memory_bytes``, else
``num_kv_blocks`` blocks, else the CPU default of ``engine.config.CPU_DEFAULT_KV_BYTES``), its host KV
tier, and ``RANK_RUNTIME_BYTES`` for the process itself. On a GPU the weights and the pool are in device
memory: the reservation is the runtime and the host tier. The weights are counted from the
checkpoint's safetensors headers (nothing is read), in the dtype the engine runs."""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.config import CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS, EngineConfig

# a rank process beyond its weights and pool: the interpreter, torch and its kernels, the Ray worker
# runtime and a step's activations (a CPU rank of the qwen3 `small` preset at PP 2 after 8 x 295-token
# prompts: 470-530 MB resident with 64 MB of weights and 64 MB of pool; the suite checks a rank's peak
# resident memory against its reservation, tests/cluster/test_memory_plan.py)
RANK_RUNTIME_BYTES = 768 << 20
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
GIB = 1 << 30


@dataclass(frozen=True)
class RankMemory:
    """One rank's host memory need in bytes, by part."""

    weights: int
    kv: int
    host_tier: int
    runtime: int = RANK_RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.host_tier + self.runtime

    def describe(self) -> str:
        parts = [f"weights {self.weights / GIB:.2f}", f"KV pool {self.kv / GIB:.2f}"]
        if self.host_tier:
            parts.append(f"host KV tier {self.host_tier / GIB:.2f}")
        parts.append(f"runtime {self.runtime / GIB:.2f}")
        return f"{self.total / GIB:.2f} GiB ({', '.join(parts)})"


@functools.lru_cache(maxsize=256)
def _header_numels(path: str, size: int, mtime_ns: int, inode: int) -> tuple[tuple[str, int], ...]:
    """Each tensor's element count from a safetensors file's header (its first bytes only); cached by
    the file's path, size, modification time and inode, so that the plans of one start (the refusal
    check, the replicas' check and the bundle size, each over every rank) read a header once and a
    rewritten checkpoint is read again."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return tuple((name, math.prod(meta["shape"])) for name, meta in header.items() if name != "__metadata__")


def _safetensors_numels(path: Path) -> dict[str, int]:
    stat = path.stat()
    return dict(_header_numels(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino))


def checkpoint_numels(model_dir: str | Path) -> dict[str, int]:
    from workers.model_source import checkpoint_files

    numels: dict[str, int] = {}
    for path in checkpoint_files(model_dir):
        numels.update(_safetensors_numels(path))
    return numels


def stage_weight_elements(numels: dict[str, int], stages: list[tuple[int, int]]) -> list[int]:
    """Elements each pipeline stage holds (all its ranks together): layer tensors by their layer's
    stage, embeddings (and OPT's ``project_in``, which follows the embedding) on the first stage,
    everything else (final norm, OPT's ``project_out``, LM head) on the last, and the token embedding on
    the last stage too where the checkpoint has no LM head (tied); position embeddings are the first
    stage's only."""
    per_stage = [0] * len(stages)
    tied = not any(name.endswith("lm_head.weight") for name in numels)
    for name, n in numels.items():
        layer = _LAYER.search(name)
        if layer is not None:
            index = int(layer.group(1))
            stage = next((s for s, (lo, hi) in enumerate(stages) if lo <= index < hi), len(stages) - 1)
            per_stage[stage] += n
        elif "embed" in name or name.endswith(("wte.weight", "wpe.weight")) or ".project_in." in name:
            per_stage[0] += n
            token_embedding = not any(part in name for part in ("position", "wpe", "project_in"))
            if tied and len(stages) > 1 and token_embedding:
                per_stage[-1] += n
        else:
            per_stage[-1] += n
    return per_stage


def dtype_bytes(config: EngineConfig, use_gpu: bool) -> int:
    """Bytes per weight element as the engine runs (``workers.worker.resolve_dtype``: for ``auto``,
    float32 on CPU, a half type on GPU)."""
    dtype = config.model.dtype
    if dtype == "auto":
        return 2 if use_gpu else 4
    return DTYPE_BYTES.get(str(dtype), 4)


def kv_bytes_per_block(config: EngineConfig, num_layers: int, elem: int) -> int:
    """An upper bound of one block's bytes on a rank holding ``num_layers`` layers (every layer a
    full-attention layer; a quantized row is head_dim codes and a two-byte scale)."""
    hf = config.model.hf_config
    heads = hf.get("num_attention_heads") or hf.get("n_head") or 1
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    per_rank = max(1, math.ceil(kv_heads / config.parallel.tensor_parallel_size))
    row = head_dim + 2 if config.cache.kv_cache_dtype != "auto" else head_dim * elem
    return 2 * num_layers * config.cache.block_size * per_rank * row


def default_kv_bytes(block: int, node_memory: list[float] | None) -> int:
    """The pool a CPU rank reserves when no size is given: the CPU default (2 GiB, at most 32768 blocks),
    and no more than a quarter of the largest node's memory where the nodes are known (the rank itself
    takes no more than a quarter of the memory free at its start), so that a small node still holds it."""
    kv = min(CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS * block)
    return min(kv, int(max(node_memory) // 4)) if node_memory else kv


def activation_bytes(config: EngineConfig, elem: int) -> int:
    """A CPU rank's step activations beyond what ``RANK_RUNTIME_BYTES`` holds: a budget of batched tokens
    times its widest rows (the MLP's gate and up outputs and their product, its experts' for the tokens'
    top-k; the attention projections and the residual), in the model's dtype, and under the bf16x3 product
    (``cpu_matmul_precision="high"``) its split copy of the rows. (A PP 2 rank of the llama
    `1b` shape cut to 8 layers once held 824 MB beyond its weights and pool, against the 805 MB reserved
    before this term; the qwen3 `small` preset's ranks hold 470-530 MB.)"""
    hf = config.model.hf_config
    hidden = int(hf.get("hidden_size") or hf.get("d_model") or 0)
    inter = int(hf.get("intermediate_size") or hf.get("ffn_dim") or 4 * hidden)
    per_expert = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0)
    experts = per_expert * int(hf.get("num_experts_per_tok") or 0)
    tp = config.parallel.tensor_parallel_size
    width = 3 * max(inter, experts) // tp + 4 * hidden
    if config.cpu_matmul_precision == "high" and elem == 4 and not config.deterministic:
        # the bf16x3 product's hi / lo copy of a step's rows (gemm_amx.cpp, one kept per process, whatever
        # threads run the steps): 4 bytes per row and input of the widest linear (the down projection's, the attention
        # output's; a MoE model's dense width counted too, and its experts' down projection, whole under
        # expert parallelism: an expert's product has at most a row per token)
        heads = int(hf.get("num_attention_heads") or 1)
        head_dim = int(hf.get("head_dim") or hidden // heads)
        expert_inputs = per_expert if hf.get("num_experts_per_tok") else 0
        width += max(hidden, inter // tp, expert_inputs, heads * head_dim // tp)
    return config.scheduler.max_num_batched_tokens * width * elem


def rank_memory(config: EngineConfig, use_gpu: bool, node_memory: list[float] | None = None) -> list[RankMemory]:
    """Every rank's need, in global rank order (stage * tp + tensor-parallel index); ``node_memory``:
    the live nodes' memory, where known (it bounds the default pool)."""
    parallel, cache = config.parallel, config.cache
    tp = parallel.tensor_parallel_size
    num_layers = int(config.model.hf_config.get("num_hidden_layers") or config.model.hf_config.get("n_layer") or 1)
    stages = parallel.stage_layers(num_layers)
    elem = dtype_bytes(config, use_gpu)
    weights = [math.ceil(n * elem / tp) for n in stage_weight_elements(checkpoint_numels(config.model.path), stages)]
    needs = []
    for (lo, hi), stage_weights in zip(stages, weights):
        block = kv_bytes_per_block(config, hi - lo, elem)
        if cache.kv_cache_memory_bytes is not None:
            kv = cache.kv_cache_memory_bytes
        elif cache.num_kv_blocks is not None:
            kv = cache.num_kv_blocks * block
        else:
            kv = default_kv_bytes(block, node_memory)
        largest = max(b - a for a, b in stages)
        host = cache.host_kv_blocks_for(kv_bytes_per_block(config, largest, elem)) * block
        if use_gpu:
            needs += [RankMemory(weights=0, kv=0, host_tier=host)] * tp
        else:
            needs += [RankMemory(weights=stage_weights, kv=kv, host_tier=host,
                                 runtime=RANK_RUNTIME_BYTES + activation_bytes(config, elem))] * tp
    return needs


def bundle_memory(config: EngineConfig, use_gpu: bool, node_memory: list[float] | None = None) -> int:
    """The ``memory`` each rank bundle reserves: the largest rank's need (the bundles are alike, so any
    rank can take any of them)."""
    return max(need.total for need in rank_memory(config, use_gpu, node_memory))


LOWER = "lower kv_cache_memory_bytes"


def memory_refusal(config: EngineConfig, use_gpu: bool, node_memory: list[float] | None) -> str | None:
    """Why the nodes cannot hold this engine's ranks (a sentence naming the need, the largest node and
    what to change), or None when they can: a rank beyond the largest node, or, with STRICT_PACK, the
    whole group beyond it."""
    if not node_memory:
        return None
    needs = rank_memory(config, use_gpu, node_memory)
    worst = max(range(len(needs)), key=lambda r: needs[r].total)
    largest = max(node_memory)
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    if needs[worst].total > largest:
        who = "the engine" if len(needs) == 1 else f"rank {worst} (stage {worst // tp} of {pp})" if pp > 1 \
            else f"rank {worst} of {tp}"
        return (f"{who} needs {needs[worst].describe()} of memory but the largest Ray node has "
                f"{largest / GIB:.2f} GiB: raise pipeline_parallel_size or tensor_parallel_size, {LOWER}, "
                f"or add larger nodes")
    group = needs[worst].total * len(needs)
    if config.parallel.placement_strategy == "STRICT_PACK" and group > largest:
        return (f"placement_strategy STRICT_PACK puts the {len(needs)} ranks on one node, which needs "
                f"{group / GIB:.2f} GiB of memory, but the largest Ray node has {largest / GIB:.2f} GiB: use "
                f"placement_strategy PACK or SPREAD, {LOWER}, or add larger nodes")
    return None


def replicas_refusal(config: EngineConfig, use_gpu: bool, node_memory: list[float] | None, replicas: int) -> str | None:
    """Why ``replicas`` engines (a Serve deployment's most) cannot all hold their ranks in the cluster's
    memory (a sentence), or None when they can or the cluster is unknown."""
    if not node_memory:
        return None
    need = bundle_memory(config, use_gpu, node_memory) * config.parallel.world_size * replicas
    if need <= sum(node_memory):
        return None
    fewer = "lower num_replicas / max_replicas, " if replicas > 1 else ""
    engines = f"{replicas} replicas need" if replicas > 1 else "the replica needs"
    return (f"{engines} {need / GIB:.2f} GiB of memory for {'their engines' if replicas > 1 else 'its engine'} but "
            f"the Ray cluster has {sum(node_memory) / GIB:.2f} GiB: {fewer}{LOWER}, or add nodes")
