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

import secrets
from dataclasses import dataclass, field

from api.partial_json import WS as _WS
from api.partial_json import Memo, find_tag, loads, partial_suffix, skip_ws, string_end, value_end

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
            value = loads(text[self.args_start:self.args_end])
            return value if isinstance(value, str) else ""
        if self.args_end is None:
            return text[self.args_start:].rstrip(_WS)
        return text[self.args_start:self.args_end]


@dataclass
class Scan:
    """``text[:content_end]`` is content; ``calls`` are the calls found after it."""

    content_end: int
    calls: list[CallSpan] = field(default_factory=list)


# --- calls in partial JSON (read with api.partial_json, resumable through a Memo) ---------------------


def _scan_object(text: str, i: int, final: bool, memo: Memo) -> tuple[CallSpan | None, int | None]:
    """The call in the object at ``text[i] == '{'`` (None if it is not one, or not yet known to be
    one) and the index after the object (None if it is unfinished or malformed)."""
    state = memo.objects.get(i)
    if state is None:
        j, name, has_args, args_start, args_end = skip_ws(text, i + 1, memo), None, False, None, None
    else:  # the state at the last key a shorter text reached: the keys before it read the same
        j, name, has_args, args_start, args_end = state

    def call(complete: bool) -> CallSpan | None:
        if name is None or not has_args:
            return None
        return CallSpan(name, args_start, args_end, complete)

    n = len(text)
    while j < n:
        memo.objects[i] = (j, name, has_args, args_start, args_end)
        if text[j] == "}":
            return call(True), j + 1
        if text[j] != '"':
            break
        key_end = string_end(text, j, memo)
        if key_end is None:
            break
        key = loads(text[j:key_end])
        j = skip_ws(text, key_end, memo)
        if j >= n or text[j] != ":":
            break
        j = skip_ws(text, j + 1, memo)
        if j >= n:
            break
        end = value_end(text, j, final, memo)
        if end == j:  # no value at all
            break
        if key == "name" and name is None:
            if end is None or text[j] != '"':
                break
            value = loads(text[j:end])
            if not isinstance(value, str) or not value:
                break
            name = value
        elif key in ("arguments", "parameters") and not has_args:
            has_args, args_start, args_end = True, j, end
        if end is None:
            break
        j = skip_ws(text, end, memo)
        if j < n and text[j] == ",":
            j = skip_ws(text, j + 1, memo)
        elif j < n and text[j] != "}":
            break
    return call(False), None


def _scan_json_calls(text: str, start: int, final: bool, memo: Memo) -> list[CallSpan]:
    """The calls of the JSON call, or list of calls, at ``start``; scanning stops at the first item
    that is not (or not yet) a call."""
    n = len(text)
    if start >= n:
        return []
    if text[start] == "{":
        span, _ = _scan_object(text, start, final, memo)
        return [span] if span is not None else []
    saved = memo.lists.get(start)
    if saved is None:
        j, calls = skip_ws(text, start + 1, memo), []
    else:  # resume after the calls a shorter text closed
        j, closed, count = saved
        calls = closed[:count]
    while j < n and text[j] == "{":
        memo.lists[start] = (j, calls, len(calls))
        span, end = _scan_object(text, j, final, memo)
        if span is None:
            break
        calls.append(span)
        if end is None:
            break
        j = skip_ws(text, end, memo)
        if j >= n or text[j] != ",":
            break
        j = skip_ws(text, j + 1, memo)
    return calls


# --- parsers ----------------------------------------------------------------------------------------


class ToolParser:
    """``scan(text, final, memo)``: where the calls of ``text`` are. ``memo`` (an ``api.partial_json.Memo``
    that scanned only shorter texts this one extends) lets the scan resume instead of reading the text
    again; the result is the same as a scan with a fresh one (None)."""

    name = ""

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        memo = Memo() if memo is None else memo
        first = find_tag(text, HERMES_START, 0, memo)
        if first < 0:
            return Scan(len(text) if final else len(text) - partial_suffix(text, HERMES_START))
        if memo.hermes is None:
            at, calls = first, []
        else:  # resume at the first block a shorter text did not close
            at, closed, count = memo.hermes
            calls = closed[:count]
        while True:
            memo.hermes = (at, calls, len(calls))
            j = skip_ws(text, at + len(HERMES_START), memo)
            if j >= len(text) or text[j] != "{":
                break
            span, end = _scan_object(text, j, final, memo)
            if span is None:
                break
            calls.append(span)
            if end is None:
                break
            at = find_tag(text, HERMES_START, end, memo)
            if at < 0:
                break
        return Scan(first, calls) if calls or not final else Scan(len(text))


class JsonParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        memo = Memo() if memo is None else memo
        start = skip_ws(text, 0, memo)
        if start < len(text) and text[start] not in "{[":
            return Scan(len(text))
        calls = _scan_json_calls(text, start, final, memo)
        return Scan(0, calls) if calls or not final else Scan(len(text))


class GenericParser(ToolParser):
    """JSON calls when the output starts with ``{`` or ``[``, else Hermes blocks."""

    name = "generic"

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        memo = Memo() if memo is None else memo
        start = skip_ws(text, 0, memo)
        if start >= len(text):
            return Scan(len(text) if final else 0)
        if text[start] in "{[":
            return JsonParser().scan(text, final, memo)
        return HermesParser().scan(text, final, memo)


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the output is a JSON list of ``{"name", "arguments"}``."""

    name = "required"

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        memo = Memo() if memo is None else memo
        start = skip_ws(text, 0, memo)
        calls = _scan_json_calls(text, start, final, memo) if start < len(text) and text[start] == "[" else []
        return Scan(0, calls) if calls or not final else Scan(len(text))


class NamedCallParser(ToolParser):
    """A named ``tool_choice``: the whole output is that function's arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def scan(self, text: str, final: bool, memo: Memo | None = None) -> Scan:
        start = skip_ws(text, 0, Memo() if memo is None else memo)
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


class _SentCall:
    """A call as sent so far. Its arguments are kept as the pieces sent (joined when read), and while
    they are the text's ``text[args_from:args_to]`` (non-string arguments of a growing text), the next
    piece is found by index instead of by comparing strings."""

    def __init__(self, call_id: str, name: str) -> None:
        self.id, self.name = call_id, name
        self._pieces: list[str] = []
        self.length = 0
        self.args_from: int | None = None
        self.args_to = 0

    @property
    def arguments(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def send(self, piece: str) -> None:
        self._pieces.append(piece)
        self.length += len(piece)


class ToolCallExtractor:
    """The calls and content of one sample, from its text as it grows. ``update`` returns what is
    new since the last update (content, call pieces); ``final`` once the sample finished.

    While each text extends the last, the parser's scan resumes from a ``Memo`` and the extractor
    looks only at what is new (calls not yet closed, content past what was sent), so a stream costs
    Python work in proportion to its length, not to its length times its deltas (a copy and a compare
    of the text, in C, remain per update). A text that does not extend the last is scanned afresh."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.calls: list[_SentCall] = []
        self._content: list[str] = []  # the content sent, in pieces
        self._content_len = 0
        self._content_is_prefix = True  # the content sent is text[:_content_len] of the last text
        self._text = ""  # the last text
        self._memo = Memo()
        self._settled = 0  # calls before this index are closed and were sent whole
        self._nonws_end = 0  # the index after the last text's last non-whitespace character

    @property
    def content(self) -> str:
        if len(self._content) > 1:
            self._content = ["".join(self._content)]
        return self._content[0] if self._content else ""

    def update(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        grown = text.startswith(self._text)
        if grown:
            old = len(self._text)
            kept = len(text[old:].rstrip(_WS))
            if kept:
                self._nonws_end = old + kept
        else:
            self._memo, self._settled, self._nonws_end = Memo(), 0, len(text.rstrip(_WS))
        self._text = text
        memo = self._memo
        scan = self.parser.scan(text, final, memo)
        content_end = scan.content_end
        # content that is only whitespace is held, and dropped when calls follow it
        if skip_ws(text, 0, memo) >= content_end and not (final and not scan.calls):
            content_end = 0
        new_content = self._new_content(text, content_end, grown)
        deltas: list[CallDelta] = []
        calls = scan.calls
        for index in range(self._settled, len(calls)):
            span = calls[index]
            if index == len(self.calls):
                self.calls.append(_SentCall(new_call_id(), span.name))
                deltas.append(CallDelta(index, "", self.calls[index].id, span.name))
            piece = self._new_arguments(self.calls[index], span, text, grown)
            if piece:
                deltas.append(CallDelta(index, piece))
        if not final:  # a closed call's span is the same in every longer text
            while self._settled < len(calls) and calls[self._settled].complete:
                self._settled += 1
        return new_content, deltas

    def _new_content(self, text: str, content_end: int, grown: bool) -> str:
        sent = self._content_len
        if grown and self._content_is_prefix:  # text[:content_end] starts with the content sent
            new = text[sent:content_end] if content_end >= sent else ""
        else:
            content, sent_text = text[:content_end], self.content
            new = content[sent:] if content.startswith(sent_text) else ""
            self._content_is_prefix = text.startswith(sent_text + new)
        if new:
            self._content.append(new)
            self._content_len += len(new)
        return new

    def _new_arguments(self, sent: _SentCall, span: CallSpan, text: str, grown: bool) -> str:
        """The arguments of ``span`` not sent yet ("" when they did not grow as an extension)."""
        start = span.args_start
        if start is not None and text[start] != '"':  # arguments written out: text[start:end]
            end = span.args_end if span.args_end is not None else max(start, self._nonws_end)
            if grown and (sent.args_from == start or sent.length == 0):
                if end <= start + sent.length:
                    return ""
                piece = text[start + sent.length:end]
                sent.send(piece)
                sent.args_from = start
                return piece
        arguments = span.arguments(text)
        if len(arguments) > sent.length and arguments.startswith(sent.arguments):
            piece = arguments[sent.length:]
            sent.send(piece)
            sent.args_from = start if start is not None and text[start] != '"' else None
            return piece
        sent.args_from = None if sent.length else sent.args_from
        return ""
