"""Engine logprobs (per token: ``{token_id: logprob}`` for the top k plus the chosen token) in the two
formats of the OpenAI API. A token's string is its own decoded text (special tokens included);
``bytes`` are that string's UTF-8 bytes. ``-inf`` becomes -9999.0, which JSON can carry."""

from __future__ import annotations

from functools import lru_cache

from api.openai_responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprobs, TopLogprob
from engine.messages import CompletionOutput
from engine.messages import PromptLogprobs as EnginePromptLogprobs
from engine.tokenizer import Tokenizer

_MIN_LOGPROB = -9999.0


class TokenTexts:
    """token id -> decoded text, cached."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 1 << 16) -> None:
        self.text = lru_cache(maxsize=cache_size)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self.text(token_id)


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: item[1], reverse=True)


def completion_logprobs(texts: TokenTexts, sample: CompletionOutput, offset: int
                        ) -> tuple[CompletionLogprobs, int]:
    """The completions format for the sample's new tokens, whose text starts at character ``offset``
    of the choice; returns it and the offset after them. ``top_logprobs`` holds the top k and the
    chosen token, most likely first."""
    result = CompletionLogprobs()
    for token_id, top in zip(sample.token_ids, sample.logprobs or ()):
        token = texts(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(_clamp(top[token_id]) if token_id in top else None)
        result.top_logprobs.append({texts(t): _clamp(lp) for t, lp in _ranked(top)})
        result.text_offset.append(offset)
        offset += len(token)
    return result, offset


def _top_logprob(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprob:
    token = texts(token_id)
    return TopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(texts: TokenTexts, sample: CompletionOutput, num_top: int) -> ChatLogprobs:
    """The chat format for the sample's new tokens: each with exactly its ``num_top`` most likely
    alternatives."""
    content = []
    for token_id, top in zip(sample.token_ids, sample.logprobs or ()):
        chosen = _top_logprob(texts, token_id, top.get(token_id, _MIN_LOGPROB))
        alternatives = [_top_logprob(texts, t, lp) for t, lp in _ranked(top)[:num_top]]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def _by_rank(item: tuple[int, tuple[float, int]]) -> int:
    return item[1][1]


def prompt_logprobs(texts: TokenTexts, entries: EnginePromptLogprobs) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then token id -> logprob, rank
    and decoded token (the top k and the prompt's own token, most likely first). Plain dicts, built on
    the Ingress's event loop: up to the engine's max_prompt_logprobs_entries of them."""
    text, floor = texts.text, _MIN_LOGPROB
    return [None if entry is None else {
        token_id: {"logprob": max(logprob, floor), "rank": rank, "decoded_token": text(token_id)}
        for token_id, (logprob, rank) in sorted(entry.items(), key=_by_rank)} for entry in entries]
