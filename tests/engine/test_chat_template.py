"""Chat templates rendered as Hugging Face transformers renders them: real-world template shapes
(ChatML with a tools section, Llama 3 with BOS, a date and a role check, Hermes tool calls, a
thinking switch) rendered by ``engine.tokenizer.Tokenizer`` and by transformers'
``apply_chat_template(tokenize=False)`` from the same model directory must be the same text; and the
compile-once cache (where templates come from and ``chat_template_kwargs``:
test_chat_template_sources.py; ``raise_exception`` and the sandbox: test_chat_template_refusals.py)."""

from __future__ import annotations

import json

import pytest

import engine.tokenizer as tokenizer_module
from engine.tokenizer import Tokenizer
from tests.engine.chat_templates import (  # noqa: F401 (frozen_now: a fixture, autouse)
    CHATML_QWEN,
    CONVERSATIONS,
    HERMES_TOOLS,
    LLAMA3,
    TEMPLATES,
    TOOLS,
    both,
    frozen_now,
    hf_render,
    model_dir,
)


# --- the same text as transformers ----------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_renders_every_conversation_as_transformers(tmp_path, template):
    ours, hf = both(model_dir(tmp_path, TEMPLATES[template]))
    assert hf.chat_template == TEMPLATES[template]
    rendered = 0
    for name, messages in CONVERSATIONS.items():
        if template == "llama3" and name.startswith("reasoning"):
            continue  # (the same as one_user for this template)
        for add_generation_prompt in (True, False):
            for tools in (None, TOOLS):
                expected = hf_render(hf, messages, add_generation_prompt, tools)
                got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
                assert got == expected, f"{template}/{name}/agp={add_generation_prompt}/tools={tools is not None}"
                for message in messages:  # the oracle's text is a real prompt, not an empty or broken one
                    if message["role"] == "user":
                        assert message["content"].strip() in got
                rendered += 1
    assert rendered >= 12


def test_template_shapes_write_what_the_model_expects(tmp_path):
    """Spot checks of the shapes themselves: BOS, the frozen date, unescaped JSON with non-ASCII."""
    llama = Tokenizer(model_dir(tmp_path / "llama", LLAMA3))
    text = llama.apply_chat_template(CONVERSATIONS["one_user"], tools=TOOLS)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 07 Mar 2026\n\n<|eot_id|>")
    assert json.dumps(TOOLS[0], indent=4, ensure_ascii=False) in text and "région's 'units'" in text
    assert text.endswith("Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    qwen = Tokenizer(model_dir(tmp_path / "qwen", CHATML_QWEN))
    text = qwen.apply_chat_template(CONVERSATIONS["tool_round"], add_generation_prompt=False, tools=TOOLS)
    assert "\n" + json.dumps(TOOLS[1], ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Zürich", "unit": "celsius"}}\n</tool_call><|im_end|>\n') in text
    hermes = Tokenizer(model_dir(tmp_path / "hermes", HERMES_TOOLS))
    text = hermes.apply_chat_template(CONVERSATIONS["one_user"], tools=TOOLS)
    assert text.startswith('<|begin_of_text|><|im_start|>system\nYou are a function calling AI model.')
    assert '{"type": "function", "function": ' + json.dumps(TOOLS[0]["function"], separators=(",", ":"),
                                                             ensure_ascii=False) + "}" in text


def test_tojson_filter_takes_transformers_arguments(tmp_path):
    template = ("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
                "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}|"
                "{{ messages[0] | tojson(ensure_ascii=true) }}")
    ours, hf = both(model_dir(tmp_path, template))
    message = {"role": "user", "content": "<a href='x'>é & ü</a>"}
    expected = "|".join([json.dumps(message, ensure_ascii=False), json.dumps(message, ensure_ascii=False, indent=2),
                         json.dumps(message, ensure_ascii=False, separators=(",", ":"), sort_keys=True),
                         json.dumps(message)])
    assert ours.apply_chat_template([message], add_generation_prompt=False) == expected
    assert hf_render(hf, [message], False) == expected


# --- compiled once ----------------------------------------------------------------------------------


def test_each_template_is_compiled_once_per_tokenizer(tmp_path, monkeypatch):
    compiled = []
    real_compile = tokenizer_module._compile

    def counting_compile(source):
        compiled.append(source)
        return real_compile(source)

    monkeypatch.setattr(tokenizer_module, "_compile", counting_compile)
    named = [{"name": "default", "template": CHATML_QWEN}, {"name": "tool_use", "template": HERMES_TOOLS}]
    ours = Tokenizer(model_dir(tmp_path, named))
    first = ours.apply_chat_template(CONVERSATIONS["one_user"])
    template = ours.compiled_chat_template()
    second = ours.apply_chat_template(CONVERSATIONS["system_turns"], add_generation_prompt=False)
    assert ours.compiled_chat_template() is template and compiled == [CHATML_QWEN]
    assert first != second
    ours.apply_chat_template(CONVERSATIONS["one_user"], tools=TOOLS)
    ours.apply_chat_template(CONVERSATIONS["tool_round"], tools=TOOLS)
    assert compiled == [CHATML_QWEN, HERMES_TOOLS] and ours.compiled_chat_template(TOOLS) is not template
    other = Tokenizer(tmp_path)
    other.apply_chat_template(CONVERSATIONS["one_user"])
    assert compiled == [CHATML_QWEN, HERMES_TOOLS, CHATML_QWEN] and other.compiled_chat_template() is not template
