"""The chat templates (real-world shapes), conversations, tokenizer directories and transformers oracle the chat-template tests share."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

import engine.tokenizer as tokenizer_module
from engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
import transformers.utils.chat_template_utils as hf_chat_template_utils  # noqa: E402

SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}

# Qwen2.5's template: ChatML with a tools section (tojson of every tool) and tool calls.
CHATML_QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.2's template: BOS, today's date through strftime_now, tools as tojson(indent=4) in the first
# user message, plus a role check through raise_exception. Not whitespace-controlled everywhere, so
# trim_blocks/lstrip_blocks matter.
LLAMA3 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception("Unknown role '" + message.role + "': roles must be user, assistant, tool or ipython.") }}
    {%- endif %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Hermes 2 Pro's tool_use template: BOS, tools as compact JSON (tojson with separators), tool calls
# with string or object arguments, tool responses grouped with loop.previtem/nextitem.
HERMES_TOOLS = """{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\nYou are a function calling AI model. You are provided with function signatures within <tools></tools> XML tags. Here are the available tools: <tools> ' }}
{%- for tool in tools %}
{%- if tool.function is defined %}
{%- set tool = tool.function %}
{%- endif %}
{{- '{"type": "function", "function": ' }}
{{- tool | tojson(separators=(",", ":")) }}
{{- '}' }}
{%- if not loop.last %}
{{- ' ' }}
{%- endif %}
{%- endfor %}
{{- ' </tools>\\nFor each function call return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-dict>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" or (message.role == "assistant" and message.tool_calls is not defined) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
    {%- for tool_call in message.tool_calls %}
       {{- '\\n<tool_call>\\n' }}
           {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
           {%- endif %}
           {{- '{' }}
           {{- '"name": "' }}
           {{- tool_call.name }}
           {{- '"' }}
           {{- ', '}}
           {%- if tool_call.arguments is defined %}
                {{- '"arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments|tojson }}
                {%- endif %}
           {%- endif %}
           {{- '}' }}
           {{- '\\n</tool_call>' }}
    {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>tool\\n' }}
        {%- endif %}
        {{- '<tool_response>\\n' }}
        {{- message.content }}
        {%- if not loop.last %}
            {{- '\\n</tool_response>\\n' }}
        {%- else %}
            {{- '\\n</tool_response>' }}
        {%- endif %}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>' }}
        {%- elif loop.last %}
            {{- '<|im_end|>' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's shape: a namespace scanned backwards with loop controls, reasoning_content in <think>, the
# enable_thinking switch (a chat_template_kwargs variable) and {% generation %} marks.
QWEN3_THINKING = """{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role != "user" %}
        {%- continue %}
    {%- endif %}
    {%- set ns.last_query_index = index %}
    {%- break %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and message.reasoning_content %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- (message.content or '') + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Zephyr's template: indented block tags without whitespace control, so lstrip_blocks and trim_blocks
# decide the text; eos_token after every turn.
ZEPHYR = """{% for message in messages %}
    {% if message['role'] == 'user' %}
        {{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
        {{ '<|system|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
        {{ '<|assistant|>\n'  + (message['content'] or '') + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
        {{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""

TEMPLATES = {"chatml_qwen": CHATML_QWEN, "llama3": LLAMA3, "hermes_tools": HERMES_TOOLS, "qwen3": QWEN3_THINKING,
             "zephyr": ZEPHYR}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather <now> in a city & its région's 'units'",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "The time", "parameters": {"type": "object",
                                                                                                 "properties": {}}}},
]

CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Hi there"}],
    "system_turns": [
        {"role": "system", "content": "You answer in one line <b>&</b>."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And times 3 — in français?"},
    ],
    "tool_round": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]},
        {"role": "tool", "name": "get_weather", "content": '{"temp": 21, "sky": "<sunny>"}'},
        {"role": "assistant", "content": "21 °C and sunny."},
        {"role": "user", "content": "Thanks!"},
    ],
    "reasoning": [
        {"role": "user", "content": "Think, then say hi"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "\nThe user wants a greeting.\n"},
    ],
    "reasoning_older_name": [  # read by templates as reasoning_content
        {"role": "user", "content": "Think, then say hi"},
        {"role": "assistant", "content": "Hi!", "reasoning": "A greeting, then."},
    ],
}


class FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 3, 7, 9, 30, tzinfo=tz)


@pytest.fixture(autouse=True)
def frozen_now(monkeypatch):
    """strftime_now reads the same fixed moment on both sides."""
    monkeypatch.setattr(tokenizer_module, "datetime", FrozenDatetime)
    monkeypatch.setattr(hf_chat_template_utils, "datetime", FrozenDatetime)


def model_dir(root: Path, chat_template=None, files: dict[str, str] | None = None, **config) -> Path:
    """A tokenizer directory transformers loads as PreTrainedTokenizerFast and the project's Tokenizer reads."""
    root.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(["hi", "there", "what", "is"])}}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(SPECIALS.values()) + ["<|im_start|>"])
    backend.save(str(root / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS, "unk_token": None, **config}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (root / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False), encoding="utf-8")
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def both(directory: Path) -> tuple[Tokenizer, object]:
    return Tokenizer(directory), transformers.AutoTokenizer.from_pretrained(str(directory))


def hf_render(hf, messages, add_generation_prompt, tools=None, **kwargs) -> str:
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  tokenize=False, **kwargs)
