"""The chat templates of the Qwen3 and Phi-3 families (templates written here in the shape of the
ones their checkpoints ship) rendered by ``engine.tokenizer.Tokenizer`` as transformers'
``apply_chat_template(tokenize=False)`` renders them: Qwen3's tools section, multi-step tool rounds
(tool responses folded into user turns), reasoning kept only after the last real query, <think>
split out of an assistant's content and the enable_thinking switch; Phi-3's <|role|> turns closed by
<|end|> with eos_token when no generation prompt follows, and Phi-4-mini's tools in the system turn."""

from __future__ import annotations

import pytest

from tests.engine.chat_templates import CONVERSATIONS, TOOLS, both, hf_render, model_dir

# Qwen3's template, in its shipped shape.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# Phi-3 / Phi-3.5-mini-instruct's template: eos_token closes a conversation given without a generation prompt.
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
        "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
        "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
        "{{'<|assistant|>\n' + (message['content'] or '') + '<|end|>\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

# Phi-4-mini-instruct's: no newlines, the tools (a JSON string) inside the system turn.
PHI4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
             "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
             "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
             "(message['content'] or '') + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")

MULTI_STEP = [  # two tool rounds after one query, the first assistant turn's thinking inside its content
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": "<think>\nTwo calls.\n</think>\n\nChecking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "tool", "name": "now", "content": "09:30"},
    {"role": "assistant", "content": "21 °C at 09:30.", "reasoning_content": "Both answered."},
]
PHI4_TOOLS = [{"role": "system", "content": "You can call tools.", "tools": '[{"name": "now", "parameters": {}}]'},
              {"role": "user", "content": "What time is it?"}]

CASES = {
    "qwen3": (QWEN3, {**CONVERSATIONS, "multi_step": MULTI_STEP}),
    "phi3": (PHI3, CONVERSATIONS),
    "phi4_mini": (PHI4_MINI, {**CONVERSATIONS, "tools_in_system": PHI4_TOOLS}),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_renders_as_transformers(tmp_path, family):
    template, conversations = CASES[family]
    ours, hf = both(model_dir(tmp_path, template))
    assert hf.chat_template == template
    for name, messages in conversations.items():
        for add_generation_prompt in (True, False):
            for tools in (None, TOOLS) if family == "qwen3" else (None,):
                for kwargs in ({}, {"enable_thinking": False}) if family == "qwen3" else ({},):
                    expected = hf_render(hf, messages, add_generation_prompt, tools, **kwargs)
                    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                   chat_template_kwargs=kwargs or None)
                    assert got == expected, f"{family}/{name}/agp={add_generation_prompt}/tools={tools is not None}"
                    for message in messages:
                        if message["role"] == "user":
                            assert message["content"] in got


def test_the_family_markers_are_where_the_model_expects_them(tmp_path):
    qwen3 = both(model_dir(tmp_path / "qwen3", QWEN3))[0]
    text = qwen3.apply_chat_template(MULTI_STEP, add_generation_prompt=False, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # reasoning after the last real query stays (both turns); tool responses are one user turn
    assert "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nChecking.\n<tool_call>\n" in text
    assert ('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n09:30\n'
            '</tool_response><|im_end|>\n') in text
    assert text.endswith("<|im_start|>assistant\n<think>\nBoth answered.\n</think>\n\n21 °C at 09:30.<|im_end|>\n")
    phi3 = both(model_dir(tmp_path / "phi3", PHI3))[0]
    one = CONVERSATIONS["one_user"]
    assert phi3.apply_chat_template(one) == "<|user|>\nHi there<|end|>\n<|assistant|>\n"
    assert phi3.apply_chat_template(one, add_generation_prompt=False) == "<|user|>\nHi there<|end|>\n<|im_end|>"
    phi4 = both(model_dir(tmp_path / "phi4", PHI4_MINI))[0]
    assert phi4.apply_chat_template(PHI4_TOOLS) == ('<|system|>You can call tools.<|tool|>[{"name": "now", '
                                                    '"parameters": {}}]<|/tool|><|end|><|user|>What time is it?'
                                                    '<|end|><|assistant|>')
