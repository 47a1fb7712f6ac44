"""A lenient reader of partial JSON, resumable: the tool-call parsers (``api.tool_parsers``) read a
model's text with it while the text grows.

Every function here is a function of the text and a start index, and what it finds about a prefix of
the text holds in every longer text. A ``Memo`` keeps, per start index, how far the last read got
(and the state it had there), so reading the same text grown by a delta resumes where the last read
stopped instead of starting over: over a whole stream each character is read a bounded number of
times, not once per delta. A fresh ``Memo`` reads a text whole; the results are the same either way.
"""

from __future__ import annotations

import json

WS = " \t\n\r"
_SCALAR_END = WS + ",]}"


class Memo:
    """How far reads of a text (a prefix of the text read now) got, per start index. Only facts that
    hold in every longer text are kept: a read that stopped at the text's end resumes there."""

    __slots__ = ("spaces", "strings", "values", "scalars", "objects", "lists", "finds", "hermes")

    def __init__(self) -> None:
        self.spaces: dict[int, int] = {}  # start -> first non-whitespace index (or the end reached)
        self.strings: dict[int, int] = {}  # start -> the closing quote's index (or the index reached)
        self.values: dict[int, tuple[int, int]] = {}  # start -> (index, bracket depth) reached
        self.scalars: dict[int, int] = {}  # start -> the index a bare scalar reached
        self.objects: dict[int, tuple] = {}  # start -> a call object's reading state at its last key
        self.lists: dict[int, tuple] = {}  # start -> (index, closed calls) of a list of calls
        self.finds: dict[int, int] = {}  # start -> where a search for the tag resumes
        self.hermes: tuple | None = None  # (index, closed calls) of the Hermes blocks read so far


def loads(text: str) -> object:
    """A JSON value, or None where the text is not one."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def skip_ws(text: str, i: int, memo: Memo) -> int:
    j = memo.spaces.get(i, i)
    n = len(text)
    while j < n and text[j] in WS:
        j += 1
    memo.spaces[i] = j
    return j


def string_end(text: str, i: int, memo: Memo) -> int | None:
    """Index after the JSON string starting at ``text[i] == '"'``; None if it is not closed yet."""
    j = memo.strings.get(i, i + 1)
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            memo.strings[i] = j
            return j + 1
        else:
            j += 1
    memo.strings[i] = j  # past the end after a final backslash: the next character is escaped
    return None


def value_end(text: str, i: int, final: bool, memo: Memo) -> int | None:
    """Index after the JSON value starting at ``i`` (strings and brackets respected); None while it
    is unfinished. A bare scalar ends at a delimiter, or at the end of a final text."""
    first = text[i]
    if first == '"':
        return string_end(text, i, memo)
    n = len(text)
    if first in "{[":
        j, depth = memo.values.get(i, (i, 0))
        while j < n:
            c = text[j]
            if c == '"':
                end = string_end(text, j, memo)
                if end is None:
                    memo.values[i] = (j, depth)
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    memo.values[i] = (j, 1)  # at the closing bracket, one level deep
                    return j + 1
            j += 1
        memo.values[i] = (j, depth)
        return None
    j = memo.scalars.get(i, i)
    while j < n and text[j] not in _SCALAR_END:
        j += 1
    memo.scalars[i] = j
    return j if j < n or final else None


def find_tag(text: str, tag: str, start: int, memo: Memo) -> int:
    """``text.find(tag, start)``, resuming where a search in a shorter text gave up (one tag per memo)."""
    at = text.find(tag, memo.finds.get(start, start))
    memo.finds[start] = at if at >= 0 else max(start, len(text) - len(tag) + 1)
    return at


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
