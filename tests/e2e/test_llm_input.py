"""What goes into the engine, end to end on the tiny llama: bad input that raises and leaves the engine
clean, and chat messages rendered by the template (with tools and template kwargs)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.sampling_common import (  # noqa: F401 (fixtures)
    GREEDY,
    as_inputs,
    assert_clean,
    tokens_of,
    greedy,
    llm,
    model_dir,
    prompts,
)


# --- bad input ------------------------------------------------------------------------------------

BAD_INPUTS = {
    "too long": ([{"prompt_token_ids": [5] * 2049}], None, "max_model_len"),
    "empty": ([{"prompt_token_ids": []}], None, "empty"),
    "id >= vocab": ([{"prompt_token_ids": [5, 4096, 6]}], None, "4096"),
    "negative id": ([{"prompt_token_ids": [5, -1]}], None, "4096"),
    "params count": ([{"prompt_token_ids": [5, 6]}] * 2, [GREEDY] * 3, "sampling params"),
    "stop id >= vocab": ([{"prompt_token_ids": [5, 6]}],
                         SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[5000]), "stop_token_ids"),
    "not a prompt": ([{"text": "hi"}], None, "prompt"),
    "one bad in a batch": ([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}, {"prompt_token_ids": []}],
                           None, "empty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_and_leaves_the_engine_clean(llm, prompts, greedy, case):
    inputs, params, message = BAD_INPUTS[case]
    before = llm.stats()
    with pytest.raises(ValueError, match=message):
        llm.generate(inputs, params)
    after = llm.stats()
    # nothing ran: no step, no prompt token scheduled, nothing allocated or queued
    for key in ("num_steps", "num_prompt_tokens", "num_generation_tokens"):
        assert after[key] == before[key], key
    assert_clean(llm)
    assert tokens_of(llm.generate(as_inputs(prompts[:2]), GREEDY)) == greedy[:2]


# --- chat -------------------------------------------------------------------------------------------


def test_chat_renders_the_template(llm):
    tokenizer = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=4))[0]
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 3 and out.prompt_token_ids.count(4) == 1  # <|im_start|>, <|im_end|>
    assert 1 <= len(out.outputs[0].token_ids) <= 4

    two = llm.chat([[{"role": "user", "content": "hi"}],
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]],
                   SamplingParams(temperature=0.0, max_tokens=2))
    assert two[0].prompt_token_ids == out.prompt_token_ids
    assert two[1].prompt_token_ids == tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)


def test_chat_passes_tools_and_template_kwargs(model_dir, tmp_path):
    """LLM.chat hands ``tools`` and ``chat_template_kwargs`` to the template (one that uses both)."""
    import shutil

    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    (local / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}tools: {{ tools | map(attribute='name') | join(',') }}\n{% endif %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}no-think\n{% endif %}")
    with LLM(model=str(local), num_kv_blocks=64, max_model_len=256) as small:
        tokenizer = small.get_tokenizer()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        out = small.chat([{"role": "user", "content": "hi"}], params, tools=[{"name": "add"}, {"name": "mul"}],
                         chat_template_kwargs={"enable_thinking": False})[0]
        plain = small.chat([{"role": "user", "content": "hi"}], params)[0]
    head = "<|im_start|>user\nhi<|im_end|>\n"
    assert out.prompt_token_ids == tokenizer.encode(head + "tools: add,mul\n<|im_start|>assistant\nno-think\n",
                                                    add_special_tokens=False)
    assert plain.prompt_token_ids == tokenizer.encode(head + "<|im_start|>assistant\n", add_special_tokens=False)
