"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed in the prefill that already runs.

The hidden state at prompt position p predicts prompt token p + 1, so each prefill chunk of a request
that asks for them yields the entries of the prompt tokens it predicts: the chunk's positions up to the
prompt's second-to-last (the last predicts the first output token, which the sampler handles). Every
rank computes the same logits rows (the LM head gathers to rank 0 across the tensor-parallel group);
rank 0 turns them into ``{token_id: (logprob, rank)}`` for the top k plus the prompt's own token, in
slices of rows so that a long chunk never holds its whole ``[tokens, vocab]`` matrix at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS_PER_SLICE = 256  # logits rows computed at once, at most: 256 x a 152k vocabulary in float32 is 150 MiB


@dataclass
class PromptRows:
    """One request's prompt positions in a step: flat rows ``flat_start .. flat_start + len(targets)`` of
    the step's hidden states hold positions ``first ..``, predicting ``targets``."""

    req_id: str
    first: int
    flat_start: int
    targets: list[int]
    k: int


def plan_prompt_rows(req_ids: list[str], query_lens: list[int], requests: dict) -> list[PromptRows]:
    """The step's prompt-logprob rows, from its requests in batch order (``query_lens`` tokens each,
    starting at their ``num_computed_tokens``)."""
    plans = []
    flat = 0
    for req_id, n in zip(req_ids, query_lens):
        state = requests[req_id]
        if state.params.prompt_logprobs is not None:
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)
            if end > start:
                plans.append(PromptRows(req_id, start, flat, state.token_ids[start + 1:end + 1],
                                        state.params.prompt_logprobs))
        flat += n
    return plans


@torch.inference_mode()
def compute_prompt_logprobs(model, hidden: torch.Tensor, plans: list[PromptRows], is_first_rank: bool,
                            rows_per_slice: int = ROWS_PER_SLICE
                            ) -> dict[str, tuple[int, list[dict[int, tuple[float, int]]]]]:
    """req_id -> (first position, one entry per predicted prompt token) on rank 0; {} elsewhere.
    ``rows_per_slice``: the runner passes at most ``max_num_seqs``, the rows whose logits and sampler
    temporaries the memory profile measured."""
    result: dict[str, tuple[int, list[dict[int, tuple[float, int]]]]] = {}
    for plan in plans:
        entries: list[dict[int, tuple[float, int]]] = []
        for a in range(0, len(plan.targets), rows_per_slice):
            b = min(a + rows_per_slice, len(plan.targets))
            logits = model.compute_logits(hidden[plan.flat_start + a:plan.flat_start + b])
            if is_first_rank:
                entries += _entries(logits, plan.targets[a:b], plan.k)
        if is_first_rank:
            result[plan.req_id] = (plan.first, entries)
    return result


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, tuple[float, int]]]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logprobs.device)
    chosen = logprobs.gather(1, target[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()  # 1 + the tokens strictly more likely
    chosen_values = chosen[:, 0].tolist()
    top_ids = top_values = None
    if k:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_ids, top_values = indices.tolist(), values.tolist()
    entries = []
    for row, token_id in enumerate(targets):
        entry = {}
        if top_ids is not None:
            entry = {t: (v, r + 1) for r, (t, v) in enumerate(zip(top_ids[row], top_values[row]))}
        entry[token_id] = (chosen_values[row], ranks[row])
        entries.append(entry)
    return entries
