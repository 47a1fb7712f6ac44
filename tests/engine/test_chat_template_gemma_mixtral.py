"""The chat templates of the Gemma 2, Gemma 3 and Mixtral families (written here in the shape of the
ones their instruct checkpoints ship) rendered by ``engine.tokenizer.Tokenizer`` as transformers'
``apply_chat_template(tokenize=False)`` renders them: Gemma's <start_of_turn> turns with the assistant
as ``model`` and trimmed content, Gemma 3's system prompt folded into the first user turn and its
list-of-parts content, Gemma 2's refusal of a system turn, Mixtral's [INST] turns closed by eos_token;
a conversation a template refuses (its raise_exception) is a ChatTemplateError, where transformers
raises too."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatTemplateError
from tests.engine.chat_templates import both, hf_render, model_dir

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

MIXTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

ONE_USER = [{"role": "user", "content": "  Hi there \n"}]
TURNS = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": " 4. "},
         {"role": "user", "content": "And times 3 — en français <b>&</b>?"}]
SYSTEM = [{"role": "system", "content": "Answer in one line."}] + TURNS
PARTS = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": " Describe "}, {"type": "text", "text": "this."}]}]
TOOL_TURN = TURNS[:2] + [{"role": "tool", "content": "21"}]  # refused by all three: roles must alternate
SWAPPED = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}]

CASES = {  # family -> (template, conversations rendered, conversations refused)
    "gemma2": (GEMMA2, {"one_user": ONE_USER, "turns": TURNS}, {"system": SYSTEM, "tool": TOOL_TURN, "swapped": SWAPPED}),
    "gemma3": (GEMMA3, {"one_user": ONE_USER, "turns": TURNS, "system": SYSTEM, "parts": PARTS},
               {"tool": TOOL_TURN, "swapped": SWAPPED}),
    "mixtral": (MIXTRAL, {"one_user": ONE_USER, "turns": TURNS, "system": SYSTEM}, {"tool": TOOL_TURN, "swapped": SWAPPED}),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_renders_as_transformers_and_refuses_what_it_refuses(tmp_path, family):
    template, rendered, refused = CASES[family]
    ours, hf = both(model_dir(tmp_path, template))
    assert hf.chat_template == template
    for name, messages in rendered.items():
        for add_generation_prompt in (True, False):
            expected = hf_render(hf, messages, add_generation_prompt)
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert got == expected, f"{family}/{name}/agp={add_generation_prompt}"
    for name, messages in refused.items():
        with pytest.raises(Exception) as hf_error:
            hf_render(hf, messages, True)
        with pytest.raises(ChatTemplateError) as ours_error:
            ours.apply_chat_template(messages, add_generation_prompt=True)
        assert str(hf_error.value) in str(ours_error.value), f"{family}/{name}"


def test_the_family_markers_are_where_the_model_expects_them(tmp_path):
    gemma3 = both(model_dir(tmp_path / "gemma3", GEMMA3))[0]
    text = gemma3.apply_chat_template(SYSTEM, add_generation_prompt=True)
    # the system prompt opens the first user turn; the assistant is "model"; content is trimmed
    assert "<start_of_turn>user\nAnswer in one line.\n\nWhat is 2 + 2?<end_of_turn>\n" in text
    assert "<start_of_turn>model\n4.<end_of_turn>\n" in text
    assert text.endswith("<start_of_turn>model\n")
    mixtral = both(model_dir(tmp_path / "mixtral", MIXTRAL))
    text = mixtral[0].apply_chat_template(SYSTEM, add_generation_prompt=False)
    eos = mixtral[1].eos_token
    assert " [INST] Answer in one line.\n\nWhat is 2 + 2? [/INST]  4. " + eos + " [INST] And times 3" in text
