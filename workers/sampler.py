"""Token sampling on rank 0: penalties, min_tokens, temperature, top-k / top-p / min-p, per-request
seeds, and logprobs of the raw distribution.

Random choice uses the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token i with
probability p_i. A seeded request draws its ``q`` from a generator seeded by (seed, output index),
so its samples depend on nothing else in the batch, and survive preemption and recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know of one request that samples this step."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    stop_ids: tuple[int, ...]  # eos + stop_token_ids: masked while fewer than min_tokens are out

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class GrammarMask:
    """A step's grammar bitmask (numpy int32, one row per constrained request) and which logits row
    each of its rows masks: row ``mask_rows[i]`` masks logits row ``logit_rows[i]``."""

    bitmask: object
    logit_rows: list[int]
    mask_rows: list[int]


def _seed_for(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + output_index) % (1 << 63)


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int, argmax=None) -> None:
        """``argmax``: a faster ``argmax(dim=-1)`` over float32 rows (the compiled CPU op), if any."""
        self.device = device
        self.argmax = argmax or _torch_argmax
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar: GrammarMask | None = None) -> tuple[list[int], list[dict | None]]:
        """``logits`` [len(rows), vocab] float32 -> (token id per row, logprobs dict or None per row).
        ``grammar``: the constrained rows' token bitmask, applied before anything else (logprobs stay
        those of the raw distribution)."""
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        constrained = ()
        if grammar is not None:
            from workers.structured_output import apply_bitmask  # only where a request is constrained

            apply_bitmask(logits, grammar.bitmask, grammar.logit_rows, grammar.mask_rows)
            constrained = set(grammar.logit_rows)  # their bitmask already holds back early stop tokens
        if any(r.params.min_tokens and r.num_output_tokens < r.params.min_tokens for r in rows):
            logits = self._mask_stop_tokens(logits.clone(), rows, constrained)
        if any(r.params.has_penalties for r in rows):
            logits = self._apply_penalties(logits.clone(), rows)

        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            token_ids = self.argmax(logits)
        else:
            token_ids = self._sample_random(logits, rows, greedy)

        ids = token_ids.tolist()
        logprobs: list[dict | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = self._logprobs_of(raw_logprobs[i], ids[i], row.params.logprobs)
        return ids, logprobs

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        temperature = torch.tensor([r.params.temperature or 1.0 for r in rows], device=logits.device)
        scaled = logits / temperature[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            threshold = torch.tensor(min_p, device=probs.device)[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None and not greedy[i]:
                self._row_generator.manual_seed(_seed_for(row.params.seed, row.num_output_tokens))
                race[i].exponential_(generator=self._row_generator)
        # a draw of exactly 0 would make p / q infinite (or NaN for a filtered token, which argmax
        # would pick): the smallest normal float keeps every quotient finite (p <= 1)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        sampled = self.argmax(probs / race)
        if any(greedy):
            is_greedy = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(is_greedy, self.argmax(logits), sampled)
        return sampled

    @staticmethod
    def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], skip=()) -> torch.Tensor:
        for i, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens and row.stop_ids and i not in skip:
                logits[i, list(row.stop_ids)] = float("-inf")
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """OpenAI presence / frequency penalties over the output; repetition penalty (divide positive
        logits, multiply negative ones) over prompt and output."""
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            p = row.params
            if not p.has_penalties:
                continue
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(row.token_ids, device=logits.device)] = True
                row_logits = logits[i]
                if p.repetition_penalty < 1.0:
                    # dividing by a small penalty can pass float32's range (down to the smallest normal
                    # float32 that validation allows): in float64, shifted so that the largest logit is
                    # 0 (what follows is shift-invariant), so no logit becomes inf and none NaN
                    row64 = row_logits.double()
                    penalised = torch.where(seen, torch.where(row64 > 0, row64 / p.repetition_penalty,
                                                              row64 * p.repetition_penalty), row64)
                    logits[i] = (penalised - penalised.max().clamp(min=0.0)).float()
                else:
                    penalised = torch.where(row_logits > 0, row_logits / p.repetition_penalty,
                                            row_logits * p.repetition_penalty)
                    logits[i] = torch.where(seen, penalised, row_logits)
            output = row.token_ids[row.num_prompt_tokens:]
            if output and (p.frequency_penalty or p.presence_penalty):
                counts = torch.zeros(vocab, device=logits.device)
                counts.index_add_(0, torch.tensor(output, device=logits.device), torch.ones(len(output), device=logits.device))
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    @staticmethod
    def _logprobs_of(row_logprobs: torch.Tensor, chosen: int, k: int) -> dict[int, float]:
        result: dict[int, float] = {}
        if k:
            values, indices = row_logprobs.topk(k)
            result = dict(zip(indices.tolist(), values.tolist()))
        result[chosen] = float(row_logprobs[chosen])
        return result


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's ``top_k`` best logits (0: all), then the smallest set whose probability reaches
    ``top_p``; the rest become -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if any(p < 1.0 for p in top_p):
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        p = torch.tensor(top_p, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
