"""Tool calls read out of a model's text, whole or while it streams.

A parser scans the text generated so far and says where the calls are: each call's name and the
span of its arguments in the text, and how much of the text is plain content. ``ToolCallExtractor``
turns successive scans into the pieces OpenAI streams (content, then per call a first piece with
``id``, ``type``, ``function.name`` and ``arguments: ""``, then argument fragments); the non-streamed
answer is the same extractor run once over the whole text, so a stream assembles to exactly the
message a non-streamed request gets.

Formats (``tool_call_parser``, as vLLM's ``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5,
  many fine-tunes); the text before the first block is the content.
- ``llama3_json``: the whole output is one JSON call ``{"name": ..., "arguments": {...}}`` (or
  ``"parameters"``, as Llama 3.1 writes it) or a JSON list of them.
- ``generic`` (the default): ``llama3_json`` when the output starts with ``{`` or ``[``, else ``hermes``.

An object is a call when it has a string ``name`` and an ``arguments`` (or ``parameters``) value; the
arguments are passed on as the text the model wrote (a JSON string value is decoded first). A text
with no call is all content. Scans are monotone: a call seen in a prefix of the text is seen in every
longer text, and its arguments only grow, which is what lets the pieces be sent as they come.

Constrained tool choices use the same machinery: ``required`` output is a JSON list of calls
(``RequiredCallsParser``), a named function's output is its arguments (``NamedCallParser``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

_WS = " \t\n\r"
HERMES_START = "<tool_call>"


@dataclass
class CallSpan:
    """One call in the text: its name and where its arguments value lies (``args_end`` None while
    the value is unfinished; ``args_start`` None when the call has no arguments key)."""

    name: str
    args_start: int | None
    args_end: int | None
    complete: bool = False  # the call's object (or the whole constrained output) is closed

    def arguments(self, text: str) -> str:
        """The arguments as far as they are known: a prefix of the final arguments."""
        if self.args_start is None:
            return "{}" if self.complete else ""
        if text[self.args_start] == '"':  # a JSON string holding the arguments: whole or nothing
            if self.args_end is None:
                return ""
            value = _loads(text[self.args_start:self.args_end])
            return value if isinstance(value, str) else ""
        if self.args_end is None:
            return text[self.args_start:].rstrip(_WS)
        return text[self.args_start:self.args_end]


@dataclass
class Scan:
    """``text[:content_end]`` is content; ``calls`` are the calls found after it."""

    content_end: int
    calls: list[CallSpan] = field(default_factory=list)


# --- a lenient reader of partial JSON ---------------------------------------------------------------


def _loads(text: str) -> object:
    """A JSON value, or None where the text is not one."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at ``text[i] == '"'``; None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int, final: bool) -> int | None:
    """Index after the JSON value starting at ``i`` (strings and brackets respected); None while it
    is unfinished. A bare scalar ends at a delimiter, or at the end of a final text."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",]}":
        j += 1
    return j if j < len(text) or final else None


def _scan_object(text: str, i: int, final: bool) -> tuple[CallSpan | None, int | None]:
    """The call in the object at ``text[i] == '{'`` (None if it is not one, or not yet known to be
    one) and the index after the object (None if it is unfinished or malformed)."""
    name: str | None = None
    args_start = args_end = None
    has_args = False

    def call(complete: bool) -> CallSpan | None:
        if name is None or not has_args:
            return None
        return CallSpan(name, args_start, args_end, complete)

    j = _skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return call(True), j + 1
        if text[j] != '"':
            break
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = _loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = _value_end(text, j, final)
        if end == j:  # no value at all
            break
        if key == "name" and name is None:
            if end is None or text[j] != '"':
                break
            value = _loads(text[j:end])
            if not isinstance(value, str) or not value:
                break
            name = value
        elif key in ("arguments", "parameters") and not has_args:
            has_args, args_start, args_end = True, j, end
        if end is None:
            break
        j = _skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = _skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "}":
            break
    return call(False), None


def _scan_json_calls(text: str, start: int, final: bool) -> list[CallSpan]:
    """The calls of the JSON call, or list of calls, at ``start``; scanning stops at the first item
    that is not (or not yet) a call."""
    if start >= len(text):
        return []
    if text[start] == "{":
        span, _ = _scan_object(text, start, final)
        return [span] if span is not None else []
    calls: list[CallSpan] = []
    j = _skip_ws(text, start + 1)
    while j < len(text) and text[j] == "{":
        span, end = _scan_object(text, j, final)
        if span is None:
            break
        calls.append(span)
        if end is None:
            break
        j = _skip_ws(text, end)
        if j >= len(text) or text[j] != ",":
            break
        j = _skip_ws(text, j + 1)
    return calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --- parsers ----------------------------------------------------------------------------------------


class ToolParser:
    name = ""

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(HERMES_START)
        if first < 0:
            return Scan(len(text) if final else len(text) - _partial_suffix(text, HERMES_START))
        calls: list[CallSpan] = []
        at = first
        while True:
            j = _skip_ws(text, at + len(HERMES_START))
            if j >= len(text) or text[j] != "{":
                break
            span, end = _scan_object(text, j, final)
            if span is None:
                break
            calls.append(span)
            if end is None:
                break
            at = text.find(HERMES_START, end)
            if at < 0:
                break
        return Scan(first, calls) if calls or not final else Scan(len(text))


class JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        start = _skip_ws(text, 0)
        if start < len(text) and text[start] not in "{[":
            return Scan(len(text))
        calls = _scan_json_calls(text, start, final)
        return Scan(0, calls) if calls or not final else Scan(len(text))


class GenericParser(ToolParser):
    """JSON calls when the output starts with ``{`` or ``[``, else Hermes blocks."""

    name = "generic"

    def scan(self, text: str, final: bool) -> Scan:
        start = _skip_ws(text, 0)
        if start >= len(text):
            return Scan(len(text) if final else 0)
        if text[start] in "{[":
            return JsonParser().scan(text, final)
        return HermesParser().scan(text, final)


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the output is a JSON list of ``{"name", "arguments"}``."""

    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        start = _skip_ws(text, 0)
        calls = _scan_json_calls(text, start, final) if start < len(text) and text[start] == "[" else []
        return Scan(0, calls) if calls or not final else Scan(len(text))


class NamedCallParser(ToolParser):
    """A named ``tool_choice``: the whole output is that function's arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> Scan:
        start = _skip_ws(text, 0)
        if start >= len(text):
            return Scan(0, [CallSpan(self.function_name, None, None, final)])
        end = len(text.rstrip(_WS)) if final else None
        return Scan(0, [CallSpan(self.function_name, start, end, final)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (GenericParser, HermesParser, JsonParser)}
DEFAULT_TOOL_PARSER = GenericParser.name


def check_tool_parser(name: str) -> str:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}")
    return name


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# --- the extractor ----------------------------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of a call: the first carries ``id`` and ``name`` (arguments ""), later ones fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class ToolCallExtractor:
    """The calls and content of one sample, from its text as it grows. ``update`` returns what is
    new since the last update (content, call pieces); ``final`` once the sample finished."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content = ""
        self.calls: list[_SentCall] = []

    def update(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        scan = self.parser.scan(text, final)
        content = text[:scan.content_end]
        # content that is only whitespace is held, and dropped when calls follow it
        if not content.strip(_WS) and not (final and not scan.calls):
            content = ""
        new_content = content[len(self.content):] if content.startswith(self.content) else ""
        self.content += new_content
        deltas: list[CallDelta] = []
        for index, span in enumerate(scan.calls):
            if index == len(self.calls):
                self.calls.append(_SentCall(new_call_id(), span.name))
                deltas.append(CallDelta(index, "", self.calls[index].id, span.name))
            sent = self.calls[index]
            arguments = span.arguments(text)
            if len(arguments) > len(sent.arguments) and arguments.startswith(sent.arguments):
                deltas.append(CallDelta(index, arguments[len(sent.arguments):]))
                sent.arguments = arguments
        return new_content, deltas
