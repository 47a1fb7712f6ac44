"""The model's tokenizer, through the `tokenizers` library (no transformers), and its chat template."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import tokenizers
from tokenizers import processors


class Tokenizer:
    """``tokenizer.json`` of a model directory; falls back to GPT-2 style vocab.json + merges.txt."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
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
    def chat_template(self) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template (the prompt text; encode it without
        adding special tokens again when the template already starts with BOS)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        import jinja2.sandbox

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )
