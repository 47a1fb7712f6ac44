"""The model's tokenizer, through the `tokenizers` library (no transformers), and its chat template,
rendered in the Jinja environment of transformers' ``apply_chat_template`` (sandboxed, ``trim_blocks``
and ``lstrip_blocks``, loop controls, a non-escaping ``tojson``, ``strftime_now``, ``raise_exception``)
so that a prompt is the text the model was trained on."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils
import tokenizers
from tokenizers import processors


class Tokenizer:
    """``tokenizer.json`` of a model directory; falls back to GPT-2 style vocab.json + merges.txt."""

    def __init__(self, model_dir: str | Path) -> None:
        root = self.root = Path(model_dir)
        config_path = root / "tokenizer_config.json"
        self.config: dict = json.loads(config_path.read_text()) if config_path.exists() else {}
        if (root / "tokenizer.json").exists():
            self.backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        elif (root / "vocab.json").exists() and (root / "merges.txt").exists():
            self.backend = self._from_vocab_and_merges(root)
        else:
            raise ValueError(f"{root} has no tokenizer.json (nor vocab.json + merges.txt)")
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        self._compiled_templates: dict[str, jinja2.Template] = {}  # template source -> compiled template

    def _special(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    def _from_vocab_and_merges(self, root: Path) -> tokenizers.Tokenizer:
        bpe = tokenizers.models.BPE.from_file(str(root / "vocab.json"), str(root / "merges.txt"))
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tokenizers.decoders.ByteLevel()
        bos = self._special("bos_token")
        if bos and self.config.get("add_bos_token", True) and backend.token_to_id(bos) is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
            )
        return backend

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens a chat template sees (``bos_token``, ``eos_token``, ...): those set in
        ``tokenizer_config.json``, else in ``special_tokens_map.json``."""
        path = self.root / "special_tokens_map.json"
        legacy = json.loads(path.read_text()) if path.exists() else {}
        tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = self.config.get(name) if self.config.get(name) is not None else legacy.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None:
                tokens[name] = str(value)
        return tokens

    @cached_property
    def chat_templates(self) -> dict[str, str]:
        """name -> chat template source. ``chat_template.jinja`` (named "default") and
        ``additional_chat_templates/<name>.jinja`` win over ``tokenizer_config.json``'s ``chat_template``,
        which is one template (named "default") or a list of ``{"name", "template"}``."""
        templates = {}
        if (self.root / "chat_template.jinja").is_file():
            templates["default"] = (self.root / "chat_template.jinja").read_text(encoding="utf-8")
        extra = self.root / "additional_chat_templates"
        for path in sorted(extra.glob("*.jinja")) if extra.is_dir() else ():
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
        if templates:
            return templates
        configured = self.config.get("chat_template")
        if isinstance(configured, list):
            return {t["name"]: t["template"] for t in configured}
        return {"default": configured} if configured else {}

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source (None when the model has none)."""
        return self.chat_templates.get("default")

    def chat_template_source(self, tools: list | None = None) -> str:
        """The template a conversation is rendered with: "tool_use" when tools are given and the model
        names one, else "default"."""
        templates = self.chat_templates
        if not templates:
            raise ValueError("this model's tokenizer has no chat template")
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" not in templates:
            raise ValueError(f"this model's tokenizer has several chat templates ({', '.join(sorted(templates))}) "
                             "and none named default")
        return templates["default"]

    def compiled_chat_template(self, tools: list | None = None) -> jinja2.Template:
        """The chat template for ``tools`` compiled once per tokenizer (then reused by every render)."""
        source = self.chat_template_source(tools)
        template = self._compiled_templates.get(source)
        if template is None:
            template = self._compiled_templates[source] = _compile(source)
        return template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """Render ``messages`` with the model's chat template as transformers' ``apply_chat_template``
        (``tokenize=False``) does: the same Jinja environment, the special tokens, ``tools`` and
        ``documents`` (None when not given) and ``chat_template_kwargs`` as further template variables.
        Returns the prompt text; encode it without adding special tokens again when the template
        already starts with BOS. A conversation the template refuses (its ``raise_exception``) or cannot
        render raises ChatTemplateError, a ValueError."""
        if not messages:
            raise ValueError("the conversation is empty: give at least one message")
        if any(not isinstance(m, dict) for m in messages):
            raise ValueError("each message must be a JSON object")
        extra = dict(chat_template_kwargs or {})
        if reserved := RESERVED_TEMPLATE_VARIABLES & extra.keys():
            raise ValueError(f"chat_template_kwargs must not set {', '.join(sorted(reserved))} "
                             "(they have their own request fields)")
        template = self.compiled_chat_template(tools)
        chat = _alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in _plain(messages)])
        variables = {**self.special_tokens, **_plain(extra)}
        try:
            return template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ArithmeticError) as exc:
            raise ChatTemplateError(f"rendering failed ({type(exc).__name__}: {exc})") from exc


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class ChatTemplateError(ValueError):
    """The chat template refused a conversation (its ``raise_exception(message)``) or failed on it."""


# --- the rendering environment of transformers' apply_chat_template ------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: ``json.dumps`` as it is (Jinja's own filter HTML-escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` in a template: builds dicts, exposes no type to climb out of the sandbox from."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` in a template, refusing underscore-prefixed attributes."""

    def __init__(*args, **kwargs) -> None:  # Jinja's signature trick: namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering
    writes its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """The value rebuilt from plain JSON types (subclasses stripped), so that the sandboxed template
    sees nothing but data."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by (``reasoning_content``, ``thinking``)."""
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased
