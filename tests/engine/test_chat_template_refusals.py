"""Chat templates that refuse: ``raise_exception`` and a failing render as ValueErrors with the template's
message, and the sandbox refusing unsafe access (dict and namespace globals still as in transformers)."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatTemplateError, Tokenizer
from tests.engine.chat_templates import (  # noqa: F401 (frozen_now: a fixture, autouse)
    CONVERSATIONS,
    LLAMA3,
    both,
    frozen_now,
    hf_render,
    model_dir,
)


# --- refusals ---------------------------------------------------------------------------------------


def test_raise_exception_is_a_value_error_with_the_templates_message(tmp_path):
    ours, hf = both(model_dir(tmp_path, LLAMA3))
    messages = [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "meanwhile"}]
    message = "Unknown role 'narrator': roles must be user, assistant, tool or ipython."
    with pytest.raises(ChatTemplateError) as caught:
        ours.apply_chat_template(messages)
    assert isinstance(caught.value, ValueError) and str(caught.value) == message
    with pytest.raises(Exception) as hf_caught:
        hf_render(hf, messages, True)
    assert str(hf_caught.value) == message


def test_a_template_that_fails_on_a_conversation_is_a_value_error(tmp_path):
    ours = Tokenizer(model_dir(tmp_path, "{{ messages[0].content + 1 }}{{ bos_token + missing }}"))
    with pytest.raises(ChatTemplateError, match=r"^rendering failed \(TypeError: "):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_dict_and_namespace_globals_as_transformers(tmp_path):
    template = ("{% set d = dict(role='x', n=1) %}{{ d | tojson }}{{ dict.fromkeys(['a', 'b'], 0) | tojson }}"
                "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
                "{% endfor %}{{ ns.count }}")
    ours, hf = both(model_dir(tmp_path, template))
    messages = CONVERSATIONS["system_turns"]
    expected = '{"role": "x", "n": 1}{"a": 0, "b": 0}4'
    assert ours.apply_chat_template(messages) == hf_render(hf, messages, True) == expected


def test_the_sandbox_refuses_unsafe_access(tmp_path):
    ours = Tokenizer(model_dir(tmp_path, "{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError, match="^rendering failed \\(SecurityError: access to attribute '__class__'"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    ours = Tokenizer(model_dir(tmp_path / "ns", "{% set ns = namespace(_x=1) %}"))
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    ours = Tokenizer(model_dir(tmp_path / "mutate", "{% set _ = messages.append(1) %}{{ messages|length }}"))
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
