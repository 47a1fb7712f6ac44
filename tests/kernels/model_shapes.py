"""The widths of real model configurations (their Hugging Face config.json values), for tests that
run the kernels at the shapes servers run them at instead of powers of two."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = True  # a SiLU/GeLU-gated MLP (gate and up fused) rather than fc1 / fc2

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Each linear layer of one tensor-parallel rank of size 1: name -> (out features, in features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        up = 2 * self.intermediate if self.gated else self.intermediate
        return {"qkv": (q + 2 * kv, self.hidden), "o": (self.hidden, q), "gate_up": (up, self.hidden),
                "down": (self.hidden, self.intermediate)}


MODELS = (
    Shape("OPT-125m", 768, 3072, 50272, 12, 12, 64, gated=False),
    Shape("Llama-3.2-1B", 2048, 8192, 128256, 32, 8, 64),
    Shape("Llama-3-8B", 4096, 14336, 128256, 32, 8, 128),
    Shape("Mistral-7B", 4096, 14336, 32000, 32, 8, 128),
    Shape("Qwen2-0.5B", 896, 4864, 151936, 14, 2, 64),
    Shape("Qwen2.5-7B", 3584, 18944, 152064, 28, 4, 128),
    Shape("Phi-3-mini", 3072, 8192, 32064, 32, 32, 96),
    Shape("Gemma-2-2B", 2304, 9216, 256000, 8, 4, 256),
)


def linear_shapes() -> dict[tuple[int, int], str]:
    """Every distinct (out, in) of the models' layers -> the first layer that has it."""
    shapes: dict[tuple[int, int], str] = {}
    for model in MODELS:
        for layer, shape in model.linears.items():
            shapes.setdefault(shape, f"{model.name} {layer}")
    return shapes
