"""Incremental detokenization of one sample, and the stop strings that end it."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

_PROMPT_CONTEXT_TOKENS = 4  # enough for a decoder to know whether the first output token starts a word


class IncrementalDetokenizer:
    """Appends the text of each new token; finds a stop string and cuts the text there.

    While streaming, the last ``len(longest stop) - 1`` characters are held back: they might be the
    start of a stop string that must not reach the client.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._backend = tokenizer.backend
        # Prime the stream by stepping through the prompt's tail, from a character boundary: a stream
        # built with ``ids=`` hands that context's text back with the first output token when the prompt
        # ends inside a character, and a tail that starts inside one leaves its stray bytes in the output.
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in self._prompt_context(prompt_token_ids, params.skip_special_tokens):
            self._stream.step(self._backend, token_id)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = 0 if self._include_stop or not self._stop else max(map(len, self._stop)) - 1
        self.text = ""
        self.num_tokens = 0
        self.num_chars_sent = 0

    def _prompt_context(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
        """The prompt's last few tokens, starting where a character starts."""
        start = max(0, len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS)
        for s in range(start, max(0, start - _PROMPT_CONTEXT_TOKENS) - 1, -1):
            if not self._backend.decode(prompt_token_ids[s:], skip_special_tokens).startswith("\ufffd"):
                return prompt_token_ids[s:]
        return prompt_token_ids[start:]

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Decode ``new_token_ids``; returns the stop string that ended the text, if any.

        ``stop_terminated``: the last token is a stop token (eos or a stop_token_id); as in vLLM, its
        text is left out unless ``include_stop_str_in_output``."""
        start = len(self.text)
        skip_last = stop_terminated and not self._include_stop
        for i, token_id in enumerate(new_token_ids):
            self.num_tokens += 1
            if skip_last and i == len(new_token_ids) - 1:
                break
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece
        if not self._stop or self.num_tokens <= self._min_tokens or len(self.text) == start:
            return None
        return self._find_stop(max(0, start - max(map(len, self._stop)) + 1))

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text so far, minus the held-back tail unless ``finished``."""
        return self.text if finished else self.text[: max(0, len(self.text) - self._holdback)]

    def take_delta(self, finished: bool) -> str:
        """The visible text not yet handed out."""
        end = max(self.num_chars_sent, len(self.visible_text(finished)))
        delta = self.text[self.num_chars_sent:end]
        self.num_chars_sent = end
        return delta
