"""Where chat templates come from (chat_template.jinja, tokenizer_config, named and additional templates)
and the variables they see (``chat_template_kwargs``, documents, None fields), as transformers has them."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer
from tests.engine.chat_templates import (  # noqa: F401 (frozen_now: a fixture, autouse)
    CHATML_QWEN,
    CONVERSATIONS,
    HERMES_TOOLS,
    LLAMA3,
    QWEN3_THINKING,
    TOOLS,
    both,
    frozen_now,
    hf_render,
    model_dir,
    transformers,
)


# --- where templates come from ----------------------------------------------------------------------


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    directory = model_dir(tmp_path, "CONFIG {{ messages[0].content }}", files={"chat_template.jinja": LLAMA3})
    ours, hf = both(directory)
    assert ours.chat_template == LLAMA3
    messages = CONVERSATIONS["system_turns"]
    text = ours.apply_chat_template(messages)
    assert text == hf_render(hf, messages, True) and text.startswith("<|begin_of_text|><|start_header_id|>")
    alone = Tokenizer(model_dir(tmp_path / "file_only", None, files={"chat_template.jinja": CHATML_QWEN}))
    assert alone.apply_chat_template(messages) == hf_render(
        transformers.AutoTokenizer.from_pretrained(str(tmp_path / "file_only")), messages, True)


def test_named_templates_pick_default_or_tool_use(tmp_path):
    named = [{"name": "default", "template": CHATML_QWEN}, {"name": "tool_use", "template": HERMES_TOOLS}]
    ours, hf = both(model_dir(tmp_path, named))
    messages = CONVERSATIONS["tool_round"]
    plain = ours.apply_chat_template(messages)
    with_tools = ours.apply_chat_template(messages, tools=TOOLS)
    assert plain == hf_render(hf, messages, True) and plain.startswith("<|im_start|>system\nYou are Qwen")
    assert with_tools == hf_render(hf, messages, True, TOOLS)
    assert with_tools.startswith("<|begin_of_text|><|im_start|>system\nYou are a function calling AI model.")
    assert ours.chat_template == CHATML_QWEN


def test_additional_template_files_and_no_default(tmp_path):
    """additional_chat_templates/<name>.jinja names templates as transformers reads them; without a
    default (and no tools to pick tool_use) rendering is refused, as in transformers."""
    directory = model_dir(tmp_path, CHATML_QWEN, files={"additional_chat_templates/tool_use.jinja": HERMES_TOOLS})
    ours, hf = both(directory)
    messages = CONVERSATIONS["one_user"]
    assert ours.apply_chat_template(messages, tools=TOOLS) == hf_render(hf, messages, True, TOOLS)
    with pytest.raises(ValueError, match="^this model's tokenizer has several chat templates \\(tool_use\\) and "
                                         "none named default$"):
        ours.apply_chat_template(messages)
    with pytest.raises(ValueError, match="no default specified"):
        hf_render(hf, messages, True)


def test_no_chat_template_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="^this model's tokenizer has no chat template$"):
        Tokenizer(model_dir(tmp_path, None)).apply_chat_template(CONVERSATIONS["one_user"])


# --- variables --------------------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(tmp_path):
    ours, hf = both(model_dir(tmp_path, QWEN3_THINKING))
    messages = CONVERSATIONS["reasoning"] + [{"role": "user", "content": "Again"}]
    off = ours.apply_chat_template(messages, chat_template_kwargs={"enable_thinking": False})
    on = ours.apply_chat_template(messages, chat_template_kwargs={"enable_thinking": True})
    assert off == hf_render(hf, messages, True, enable_thinking=False)
    assert on == hf_render(hf, messages, True, enable_thinking=True) == ours.apply_chat_template(messages)
    assert off == on + "<think>\n\n</think>\n\n"
    llama, hf_llama = both(model_dir(tmp_path / "llama", LLAMA3))
    given = {"date_string": "01 Jan 2030", "tools_in_user_message": False}
    text = llama.apply_chat_template(CONVERSATIONS["one_user"], tools=TOOLS, chat_template_kwargs=given)
    assert text == hf_render(hf_llama, CONVERSATIONS["one_user"], True, TOOLS, **given)
    assert "Today Date: 01 Jan 2030\n\nYou have access to the following functions." in text
    bos = llama.apply_chat_template(CONVERSATIONS["one_user"], chat_template_kwargs={"bos_token": "<BOS>"})
    assert bos.startswith("<BOS><|start_header_id|>")  # kwargs win over special tokens, as in transformers


def test_chat_template_kwargs_cannot_replace_the_request_variables(tmp_path):
    ours = Tokenizer(model_dir(tmp_path, CHATML_QWEN))
    for name in ("messages", "tools", "documents", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"^chat_template_kwargs must not set {name} "):
            ours.apply_chat_template(CONVERSATIONS["one_user"], chat_template_kwargs={name: []})


def test_documents_and_none_fields_as_transformers(tmp_path):
    template = ("{% if documents is none %}NONE{% else %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]"
                "{% endfor %}{% endif %}{% if tools is none %}|no tools{% endif %}"
                "{% for m in messages %}|{{ m.role }}{% if m.content is defined %}={{ m.content }}{% endif %}"
                "{% endfor %}")
    ours, hf = both(model_dir(tmp_path, template))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    documents = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    for docs in (None, documents):
        got = ours.apply_chat_template(messages, documents=docs)
        assert got == hf.apply_chat_template(messages, documents=docs, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages, documents=documents) == "[A: alpha][B: beta]|no tools|user=q|assistant"
    assert ours.apply_chat_template(messages) == "NONE|no tools|user=q|assistant"
