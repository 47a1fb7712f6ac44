"""The xgrammar backend of constrained decoding: the tokenizer's vocabulary as xgrammar sees it, grammar
compilation (JSON schema, JSON object, regex, choice, EBNF), per-request matchers, token bitmasks, and
the masking of logits on the sampling rank.

The engine loads this module by name (``engine.structured_output``), so that ``engine`` stays free
of torch. Bitmasks are numpy int32 arrays, ``ceil(vocab_size / 32)`` words per row, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed: xgrammar's layout, and plain data between processes.
"""

from __future__ import annotations

import json
import re

import numpy as np
import torch
import xgrammar as xgr

from workers.json_schema_support import check_json_schema

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar 0.2.9 spells the characters of a string with minLength / maxLength as this class, which
# lets raw control characters (invalid in JSON) through; they are excluded as in its other strings
_LENGTH_CLASS, _JSON_CHAR_CLASS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def _clean(exc: BaseException) -> str:
    """xgrammar's reason in one line: without its log prefix ("[12:00:00] /path/file.cc:12: "), its
    check boilerplate, and the echo of the input it adds to JSON parse errors."""
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
    text = text.split(" The JSON string is:")[0]
    text = " ".join(text.split())
    return text.rstrip(".") + "."


def _ebnf_literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


def _vocab_type(backend_json: dict) -> tuple[xgr.VocabType, bool]:
    """(how the vocabulary encodes text, whether encoding adds a leading space), from the decoder."""
    decoder = backend_json.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    prefix = any(step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never"
                 or step.get("type") == "Strip" and step.get("content") == " " for step in steps)
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK, prefix
    return xgr.VocabType.RAW, prefix


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of ``tokenizer`` (the engine's ``Tokenizer``) over the model's ``vocab_size``
    logits: special tokens (and ids past the tokenizer, a padded vocab) are never allowed inside a
    grammar; the stop tokens end it; other added tokens are their literal text."""
    backend = tokenizer.backend
    vocab_type, add_prefix_space = _vocab_type(json.loads(backend.to_str()))
    encoded = [""] * vocab_size  # "" marks a special token for xgrammar
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    to_unicode = _bytes_to_unicode()
    for token_id, added in backend.get_added_tokens_decoder().items():
        if token_id >= vocab_size:
            continue
        if added.special:
            encoded[token_id] = ""
        elif vocab_type == xgr.VocabType.BYTE_LEVEL:  # literal text: spelled in the byte alphabet
            encoded[token_id] = "".join(to_unicode[b] for b in added.content.encode("utf-8"))
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids) or None, add_prefix_space=add_prefix_space)


class XgrammarBackend:
    """One engine's grammar backend. ``compile`` is safe to call from several threads at once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, compile_threads: int = 2) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # the engine keeps its own cache of compiled grammars (keyed by kind and spec)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=compile_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.terminate_without_stop = not stop_token_ids
        self._batch = None

    def compile(self, kind: str, spec) -> xgr.CompiledGrammar:
        """Compile a constraint; ValueError (one sentence, xgrammar's reason) if it does not compile or
        uses what xgrammar would not enforce."""
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[kind]
        if kind == "json":
            schema = spec
            if isinstance(spec, str):
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"invalid JSON schema for structured outputs: it is not valid JSON "
                                     f"({exc}).") from None
            check_json_schema(schema)
        try:
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
                ebnf = str(grammar)
                if _LENGTH_CLASS in ebnf:
                    return self.compiler.compile_grammar(ebnf.replace(_LENGTH_CLASS, _JSON_CHAR_CLASS))
                return self.compiler.compile_grammar(grammar)
            if kind == "json_object":
                return self.compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=True)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in spec))
            return self.compiler.compile_grammar(spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError (C++) or ValueError
            raise ValueError(f"invalid {what} for structured outputs: {_clean(exc)}") from None

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled, terminate_without_stop_token=self.terminate_without_stop)

    def fill_bitmask(self, matchers: list, forbidden: list[tuple[int, ...]]) -> np.ndarray:
        """The allowed next tokens of each matcher, one bitmask row each. ``forbidden[i]``: tokens row
        i must not take now (stop tokens before min_tokens), unless nothing else is allowed."""
        bitmask = np.full((len(matchers), self.words), -1, dtype=np.int32)
        if len(matchers) > 4:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(2)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        for i, tokens in enumerate(forbidden):
            if tokens:
                row = bitmask[i].copy()
                words = row.view(np.uint32)
                for t in tokens:
                    if t < self.vocab_size:
                        words[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
                if row.any():
                    bitmask[i] = row
        return bitmask

    @staticmethod
    def accept(matcher: xgr.GrammarMatcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    @staticmethod
    def is_terminated(matcher: xgr.GrammarMatcher) -> bool:
        return matcher.is_terminated()


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, logit_rows: list[int], mask_rows: list[int]) -> None:
    """Set to -inf, in place, every logit of row ``logit_rows[i]`` whose token bit is clear in row
    ``mask_rows[i]`` of ``bitmask``; columns past the bitmask's width (none, when it was made for
    this vocab) are masked too. Other rows are untouched."""
    vocab = logits.shape[-1]
    mask = torch.from_numpy(bitmask)
    if mask_rows != list(range(len(mask_rows))) or len(mask_rows) != logits.shape[0] or logit_rows != mask_rows:
        full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32)
        full[logit_rows] = mask[mask_rows]
        mask = full
    if mask.shape[1] * 32 < vocab:
        logits[logit_rows, mask.shape[1] * 32:] = float("-inf")
        vocab = mask.shape[1] * 32
    backend = "cpu" if logits.device.type == "cpu" else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device), vocab_size=vocab, indices=logit_rows,
                                    backend=backend)
