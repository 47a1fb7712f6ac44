"""`kvserve bench-kv-quant --parts sources`: where a quantized pool's error comes from.

Transformers' own model is run with its keys and values rounded through a format exactly as a pool stores
them (``kernels.kv_quant``: per token and KV head, the scale a bfloat16), after the rotary embedding and any
key norm, as the pool holds them. Each variant rounds a different part:

- ``keys and values``: what a pool of that format does (the accuracy part measures the engine itself);
- ``keys only`` / ``values only``: the other one kept exact, so each part's own share of the error shows;
- ``keys rotated``: keys and values rounded, the keys first turned by a normalised Hadamard matrix (and back
  after rounding; ``q . k`` is unchanged by the turn itself). A fixed orthogonal turn spreads a key's few
  large channels over all of them: where keys have such outlier channels it lowers the error of formats
  whose step follows the row's largest value (int8); a float format's error is relative to each value, so
  there the turn can only help where queries and keys share outlier channels. Heads whose size is not a
  power of two have no such matrix here, and the variant is reported as skipped.

The control (``control_agreement``, from the unrounded forward every variant is compared with): the share of
generated positions where that forward's argmax is the continuation's token, 100% unless the continuations
and the scoring disagree by themselves.

Teacher forcing on transformers' greedy continuations of the workloads' prompts (an argmax of the same full
forward that scores them, no KV cache and none of a checkpoint's generation settings): every variant is
scored on the same tokens; |Δ logprob| of the chosen token against the unrounded model at every position,
and greedy agreement at the generated positions.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

from benchmarks.kv_quant import _stats, chosen, hf_log_softmax, load_hf
from kernels.kv_quant import dequantize, quantize

VARIANTS = ("keys and values", "keys only", "values only", "keys rotated")
ATTENTION_NAME = "kvserve_kv_rounding"


@functools.lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of size ``n`` (a power of two): orthogonal and symmetric."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).float()


def rounded(x: torch.Tensor, fmt: str, turn: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``x`` [..., head_dim] as a pool of format ``fmt`` gives them back (turned by ``turn`` first and
    back after, if given), in ``x``'s dtype."""
    y = x.float() if turn is None else x.float() @ turn
    y = dequantize(quantize(y, fmt), fmt)
    return (y if turn is None else y @ turn.T).to(x.dtype)


class _Rounding:
    """The attention function's setting: the format (None: exact) and the variant."""
    fmt: str | None = None
    variant: str = VARIANTS[0]


def _eager(module):
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _attention(module, query, key, value, attention_mask, **kwargs):
    fmt, variant = _Rounding.fmt, _Rounding.variant
    if fmt is not None:
        if variant != "values only":
            key = rounded(key, fmt, hadamard(key.shape[-1]) if variant == "keys rotated" else None)
        if variant != "keys only":
            value = rounded(value, fmt)
    return _eager(module)(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def rounding(fmt: str | None, variant: str = "keys and values"):
    before = _Rounding.fmt, _Rounding.variant
    _Rounding.fmt, _Rounding.variant = fmt, variant
    try:
        yield
    finally:
        _Rounding.fmt, _Rounding.variant = before


def load_model(model: str):
    """Transformers' model in float32 with the rounding attention (its own eager attention inside)."""
    from workers.model_builder import without_triton

    with without_triton():  # transformers' import would leave Triton's exit-time leak report on stderr
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    # transformers builds no mask at all for an attention name it has no mask function for
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)
    hf = load_hf(model, attn_implementation=ATTENTION_NAME)
    attention = [m for m in hf.modules() if type(m).__name__.endswith("Attention")]
    if not attention or any(_eager(m) is None for m in attention):
        raise ValueError(f"{type(hf).__name__} has no eager attention function to round the keys and values in")
    return hf


def greedy_sequences(hf, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """Each prompt and its ``output_len`` argmax tokens, each from a full forward of what came before."""
    out = []
    for prompt in prompts:
        s = list(prompt)
        for _ in range(output_len):
            with torch.no_grad():
                s.append(int(hf(torch.tensor([s])).logits[0, -1].argmax()))
        out.append(s)
    return out


def error_sources(hf, prompts: list[list[int]], output_len: int, formats) -> dict:
    """Each format's variants scored on transformers' greedy continuations of ``prompts``."""
    def agreement(lp, s, p) -> list[bool]:  # at the generated positions: the argmax is the token
        return (lp[len(p) - 1:].argmax(dim=-1) == torch.tensor(s[len(p):])).tolist()

    with rounding(None):
        sequences = greedy_sequences(hf, prompts, output_len)
        unrounded = [hf_log_softmax(hf, s) for s in sequences]
    exact = [chosen(lp, s) for lp, s in zip(unrounded, sequences)]
    control = [a for lp, s, p in zip(unrounded, sequences, prompts) for a in agreement(lp, s, p)]
    config = hf.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    report = {"sequences": len(sequences), "generated_positions": sum(len(s) - len(p) for s, p in zip(sequences, prompts)),
              "control_agreement": sum(control) / max(len(control), 1), "formats": {}}
    for fmt in formats:
        report["formats"][fmt] = {}
        for variant in VARIANTS:
            if variant == "keys rotated" and head_dim & (head_dim - 1):
                report["formats"][fmt][variant] = {"skipped": f"no Hadamard matrix of size {head_dim}"}
                continue
            deltas, agree = [], []
            for s, p, base in zip(sequences, prompts, exact):
                with rounding(fmt, variant):
                    lp = hf_log_softmax(hf, s)
                deltas += (chosen(lp, s) - base).abs().tolist()
                agree += agreement(lp, s, p)
            report["formats"][fmt][variant] = {"delta_logprob": _stats(deltas),
                                               "greedy_agreement": sum(agree) / max(len(agree), 1)}
    return report


def format_sources(name: str, report: dict) -> list[str]:
    lines = ["", f"error sources, {name} (transformers, teacher-forced on its own greedy continuations): "
             f"{report['sequences']} sequences, {report['generated_positions']} generated positions; the unrounded "
             f"model's own agreement {100 * report['control_agreement']:.2f}%", "",
             "| format | rounded | |Δ logprob| mean / p99 / max | greedy agreement |", "|---|---|---|---:|"]
    for fmt, variants in report["formats"].items():
        for variant, e in variants.items():
            if "skipped" in e:
                lines.append(f"| {fmt} | {variant} | {e['skipped']} | - |")
                continue
            d = e["delta_logprob"]
            lines.append(f"| {fmt} | {variant} | {d['mean']:.5f} / {d['p99']:.5f} / {d['max']:.5f} | "
                         f"{100 * e['greedy_agreement']:.2f}% |")
    return lines
