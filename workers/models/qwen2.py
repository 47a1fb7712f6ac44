"""Qwen2: the Llama architecture with biases on the q, k and v projections only.

Sliding-window layers (``use_sliding_window``) are not modelled here; ``registry.sliding_window``
reports the window so the engine can keep contexts within it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from workers.models.llama import LlamaArgs, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """One tensor-parallel rank of a Qwen2 causal LM (tied embeddings in the small sizes)."""

    @staticmethod
    def parse_config(hf_config: dict[str, Any]) -> LlamaArgs:
        return replace(LlamaArgs.from_hf(hf_config), qkv_bias=True, o_bias=False)
