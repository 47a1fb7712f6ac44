"""IncrementalDetokenizer on a real byte-level BPE tokenizer: incremental text equals a one-shot decode
(multi-byte characters split across tokens included), stop strings cut the text where vLLM cuts it,
and streamed deltas never hand out text that a stop string later takes back."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from workers.model_builder import CORPUS_PATH

REPLACEMENT = "\ufffd"
NON_ASCII = ["🍜", "東", "👋", "ở", "❤", "é", "Б", "°"]


@pytest.fixture(scope="module")
def tokenizer(model_dirs) -> Tokenizer:
    return Tokenizer(model_dirs["llama"])


def corpus_snippet(char: str, radius: int = 40) -> str:
    text = CORPUS_PATH.read_text()
    i = text.index(char)
    return text[max(0, i - radius):i + radius]


def detokenize(tokenizer, ids, params=None, prompt=None, chunk=1) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, params or SamplingParams(), prompt or tokenizer.encode("Notes:"))
    for i in range(0, len(ids), chunk):
        detok.update(ids[i:i + chunk])
    return detok


@pytest.mark.parametrize("char", NON_ASCII)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_equals_decode(tokenizer, char, chunk):
    ids = tokenizer.encode(corpus_snippet(char), add_special_tokens=False)
    detok = detokenize(tokenizer, ids, chunk=chunk)
    assert detok.text == tokenizer.decode(ids)
    assert char in detok.text and REPLACEMENT not in detok.text
    assert detok.num_tokens == len(ids)


def test_snippets_do_split_characters_across_tokens(tokenizer):
    """The corpus snippets above really exercise multi-byte characters cut between tokens."""
    split = [c for c in NON_ASCII
             if any(REPLACEMENT in tokenizer.decode([t])
                    for t in tokenizer.encode(corpus_snippet(c), add_special_tokens=False))]
    assert {"🍜", "東", "👋", "❤"} <= set(split)


@pytest.mark.parametrize("char", ["🍜", "東", "👋", "ở", "❤"])
def test_every_prompt_output_split_decodes_without_leaking_the_prompt(tokenizer, char):
    """Cut a snippet into prompt + output at every token. The output text is what follows the prompt's
    last complete character: the prompt's own text never reappears in it (a prompt ending inside a
    character used to hand the prompt's last tokens' text back as output)."""
    ids = tokenizer.encode(corpus_snippet(char, 24), add_special_tokens=False)
    full = tokenizer.decode(ids)
    cut_inside_a_character = 0
    for k in range(1, len(ids)):
        clean = k
        while clean > 0 and tokenizer.decode(ids[:clean]).endswith(REPLACEMENT):
            clean -= 1
        cut_inside_a_character += clean < k
        detok = detokenize(tokenizer, ids[k:], prompt=ids[:k])
        assert detok.text == full[len(tokenizer.decode(ids[:clean])):], f"split at token {k}"
    assert cut_inside_a_character > 0


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [2]  # </s>
    assert detokenize(tokenizer, ids).text == "hello world"
    keep = detokenize(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert keep.text == "hello world</s>"


# --- stop strings ------------------------------------------------------------------------------------

TEXT = " The cat sat on the mat and the dog sat on the rug."


def run_until_stop(tokenizer, text, params) -> tuple[IncrementalDetokenizer, str | None, int]:
    """Feed ``text``'s tokens one at a time; returns the detokenizer, the stop string and how many
    tokens it took."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, params, tokenizer.encode("Story:"))
    for n, token in enumerate(ids, 1):
        stop = detok.update([token])
        if stop is not None:
            return detok, stop, n
    return detok, None, len(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tokenizer, include):
    params = SamplingParams(stop=["mat"], include_stop_str_in_output=include)
    detok, stop, _ = run_until_stop(tokenizer, TEXT, params)
    assert stop == "mat"
    assert detok.text == (" The cat sat on the mat" if include else " The cat sat on the ")


def test_no_stop_string_keeps_everything(tokenizer):
    detok, stop, n = run_until_stop(tokenizer, TEXT, SamplingParams(stop=["zebra"]))
    assert stop is None and detok.text == TEXT
    assert n == len(tokenizer.encode(TEXT, add_special_tokens=False))


def two_token_stop(tokenizer, text) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next; and the index of the
    second token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    for i in range(len(pieces) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(left) >= 2 and len(right) >= 2:
            stop = left[-2:] + right[:2]
            if text.find(stop) == len("".join(pieces[:i + 1])) - 2:
                return stop, i + 1
    raise AssertionError("no two-token stop string in the text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tokenizer, include):
    stop, second = two_token_stop(tokenizer, TEXT)
    detok, found, n = run_until_stop(tokenizer, TEXT, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    assert found == stop and n == second + 1  # found by the token that completes it
    end = TEXT.index(stop) + (len(stop) if include else 0)
    assert detok.text == TEXT[:end]


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # all tokens in one update: every stop is present; the one that starts first wins, whatever the order
    for stops in (["rug", "dog", "mat"], ["mat", "dog", "rug"], ["on the", "sat on"]):
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops), tokenizer.encode("Story:"))
        found = detok.update(ids)
        expected = min(stops, key=TEXT.index)
        assert found == expected
        assert detok.text == TEXT[:TEXT.index(expected)]


def test_nothing_is_checked_before_min_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # the first " sat" is complete after `first` tokens; the second one comes later
    first = next(n for n in range(1, len(ids)) if "sat" in tokenizer.decode(ids[:n]))
    params = SamplingParams(stop=["sat"], min_tokens=first, max_tokens=None)
    detok, found, n = run_until_stop(tokenizer, TEXT, params)
    assert found == "sat" and n > first + 1
    assert detok.text == TEXT[:TEXT.index("sat", TEXT.index("sat") + 1)]
    # min_tokens past the end: never stops
    params = SamplingParams(stop=["sat"], min_tokens=len(ids), max_tokens=None)
    detok, found, _ = run_until_stop(tokenizer, TEXT, params)
    assert found is None and detok.text == TEXT
    # and without min_tokens the first occurrence stops it
    _, found, n = run_until_stop(tokenizer, TEXT, SamplingParams(stop=["sat"]))
    assert found == "sat" and n == first


STREAM_TEXT = " We STOCK the STORE and then STOP the cart, STOP."


@pytest.mark.parametrize("stops, include", [
    (["STOP"], False), (["STOP"], True), (["STOP", "cart"], False), (["XYZW", "STOP the"], False),
    (["never there"], False),
])
def test_streamed_deltas_never_leak_a_stop_string(tokenizer, stops, include):
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    hits = [(STREAM_TEXT.index(s), s) for s in stops if s in STREAM_TEXT]
    if hits:
        index, stop = min(hits)
        final = STREAM_TEXT[:index + (len(stop) if include else 0)]
    else:
        final = STREAM_TEXT
    holdback = 0 if include else max(map(len, stops)) - 1
    detok = IncrementalDetokenizer(tokenizer, params, tokenizer.encode("Story:"))
    sent = ""
    for n, token in enumerate(ids, 1):
        found = detok.update([token])
        finished = found is not None or n == len(ids)
        sent += detok.take_delta(finished)
        assert final.startswith(sent), f"after token {n} the client has {sent!r}"
        if not finished:
            # only the tail that could still start a stop string is held back
            assert len(sent) >= len(detok.text) - holdback
        if finished:
            break
    assert sent == final == detok.text
    assert detok.take_delta(True) == ""


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_leaves_its_text_out(tokenizer, include):
    """The engine ended the sample on a stop token (eos or a stop_token_id): as in vLLM, that token's
    text is not output unless include_stop_str_in_output."""
    ids = tokenizer.encode(" The cat sat", add_special_tokens=False)
    params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, params, tokenizer.encode("Story:"))
    assert detok.update(ids[:-1]) is None
    assert detok.update(ids[-1:], stop_terminated=True) is None
    assert detok.text == tokenizer.decode(ids if include else ids[:-1])
    assert detok.num_tokens == len(ids)
    eos = IncrementalDetokenizer(tokenizer, params, tokenizer.encode("Story:"))
    eos.update(ids + [2], stop_terminated=True)
    assert eos.text == " The cat sat" + ("</s>" if include else "")
