"""The bounds on what one constraint may ask the grammar compiler for, checked at admission before
anything parses, hashes or compiles it (a ValueError naming the bound: HTTP 400, gRPC INVALID_ARGUMENT).

A grammar's compile time and size grow with the constraint's text, with how deeply it nests (a schema
200 levels deep took 2.6 s to compile on a 4k vocabulary, against 2 ms at 10) and with the counts it
spells out (``maxLength``, ``minItems``, ``{n,m}`` in a regex or a grammar). Each is bounded by an
engine setting; nesting is measured without recursion, so a schema nested thousands deep is refused
by the same check as one nested 40 deep, never by a RecursionError. What the bounds leave (a compile
of a schema within them) is bounded in time by ``structured_output_compile_timeout_s``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import accumulate

# JSON Schema keywords whose value is a count the grammar spells out (its size or compile time grows
# with the value)
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
# a repetition count of a regex or an EBNF grammar: {n}, {n,}, {n,m}, {,m}
_REPEAT = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class StructuredOutputBounds:
    max_length: int = 65536  # characters of a schema's JSON text, a regex, a grammar, the choices together
    max_depth: int = 64  # nesting: of a schema's JSON (objects and arrays), of a regex's or grammar's brackets
    max_count: int = 4096  # a count keyword's value, a {n,m} repetition's bound

    def check(self, kind: str, spec) -> None:
        """Raise ValueError naming the first bound ``spec`` (of constraint ``kind``) exceeds."""
        if kind == "json":
            self._check_json(spec)
        elif kind in ("regex", "grammar"):
            what = "regex" if kind == "regex" else "grammar"
            self._check_length(len(spec), f"the {what}")
            structure = structure_of(spec, grammar=kind == "grammar")  # no classes, no quoted literals
            self._check_brackets(structure, f"the {what}")
            self._check_repeats(structure, f"the {what}")
        elif kind == "choice":
            self._check_length(sum(len(c) for c in spec), "the choices")

    def _check_length(self, length: int, what: str) -> None:
        if length > self.max_length:
            raise ValueError(f"{what} for structured outputs is {length} characters long, more than "
                             f"structured_output_max_length={self.max_length} allows.")

    def _too_deep(self, what: str) -> ValueError:
        return ValueError(f"{what} for structured outputs nests more than structured_output_max_depth="
                          f"{self.max_depth} levels deep.")

    def _check_json(self, spec) -> None:
        if isinstance(spec, str):  # nesting first, as for a parsed schema: the same schema, the same refusal
            if json_text_depth(spec) > self.max_depth:
                raise self._too_deep("the JSON schema")
            self._check_length(len(spec), "the JSON schema")
            try:
                spec = json.loads(spec)
            except ValueError:
                return  # not JSON: the backend says so
        counts: list[tuple[str, object]] = []
        patterns: list[str] = []
        stack = [(spec, 1)]
        while stack:  # every container of the document, iteratively
            node, depth = stack.pop()
            if depth > self.max_depth:
                raise self._too_deep("the JSON schema")
            if isinstance(node, dict):
                counts.extend((key, node[key]) for key in COUNT_KEYWORDS if key in node)
                if isinstance(node.get("pattern"), str):
                    patterns.append(node["pattern"])
                children = node.values()
            elif isinstance(node, list):
                children = node
            else:
                continue
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
        for key, value in counts:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > self.max_count:
                raise ValueError(f"JSON schema keyword {key!r} is {value}, more than structured outputs allow "
                                 f"(structured_output_max_count={self.max_count}).")
        for pattern in patterns:
            self._check_repeats(structure_of(pattern, grammar=False), "a JSON schema 'pattern'")
        self._check_length(len(json.dumps(spec)), "the JSON schema")

    def _check_repeats(self, text: str, what: str) -> None:
        for match in _REPEAT.finditer(text):
            for bound in match.groups():
                # digits compared first: int() of a 5000-digit count raises Python's own limit error
                if bound and (len(bound.lstrip("0")) > len(str(self.max_count)) or int(bound) > self.max_count):
                    text = match.group(0) if len(match.group(0)) <= 32 else f"{{{bound[:12]}...}} ({len(bound)} digits)"
                    raise ValueError(f"{what} for structured outputs repeats {text} times, "
                                     f"more than structured_output_max_count={self.max_count} allows.")

    def _check_brackets(self, text: str, what: str) -> None:
        depth = 0
        escaped = False
        for c in text:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c in "([":
                depth += 1
                if depth > self.max_depth:
                    raise self._too_deep(what)
            elif c in ")]":
                depth = max(0, depth - 1)


def structure_of(text: str, *, grammar: bool) -> str:
    """``text`` (a regex or a grammar) with each character class ``[...]`` (escapes and a leading
    ``]`` or ``^]`` inside it included) and, in a grammar, each quoted literal ``"..."`` replaced by
    one ``x``: what is left is what nests and repeats (``[(]`` is one character, not a group)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            out.append(text[i:i + 2])
            i += 2
        elif c == "[" or (grammar and c == '"'):
            close = "]" if c == "[" else '"'
            i += 1
            if c == "[":
                i += text.startswith("^", i)
                i += text.startswith("]", i)  # a leading ] is a member, not the end
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append("x")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def json_text_depth(text: str) -> int:
    """How deeply the JSON text nests (objects and arrays, outside strings), counted without parsing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)  # a JSON string (unclosed: to the end)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"{": 1, "[": 1, "}": -1, "]": -1}
