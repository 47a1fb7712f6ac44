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
        self._stream = DecodeStream(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = 0 if self._include_stop or not self._stop else max(map(len, self._stop)) - 1
        self.text = ""
        self.num_tokens = 0
        self.num_chars_sent = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode ``new_token_ids``; returns the stop string that ended the text, if any."""
        start = len(self.text)
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            self.num_tokens += 1
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
