"""The OpenAI rendering of prompt logprobs: plain dicts (not a pydantic model per entry: a response holds
up to max_prompt_logprobs_entries of them, rendered on the Ingress's event loop), most likely first,
-inf as -9999.0, token ids as the JSON keys."""

from __future__ import annotations

import json

from api.openai_logprobs import TokenTexts, prompt_logprobs
from api.openai_responses import ChatCompletionResponse, CompletionChoice, UsageInfo


class Tokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return f"<{token_ids[0]}>"


texts = TokenTexts(Tokenizer())


ENTRIES = [None, {7: (-0.5, 1), 3: (-2.0, 2)}, {9: (-1.0, 1), 4: (float("-inf"), 3), 2: (-1.5, 2)}]


def test_entries_are_plain_dicts_most_likely_first():
    rendered = prompt_logprobs(texts, ENTRIES)
    assert rendered == [None, {7: {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
                               3: {"logprob": -2.0, "rank": 2, "decoded_token": "<3>"}},
                        {9: {"logprob": -1.0, "rank": 1, "decoded_token": "<9>"},
                         2: {"logprob": -1.5, "rank": 2, "decoded_token": "<2>"},
                         4: {"logprob": -9999.0, "rank": 3, "decoded_token": "<4>"}}]
    assert all(type(value) is dict for entry in rendered[1:] for value in entry.values())
    assert [list(entry) for entry in rendered[1:]] == [[7, 3], [9, 2, 4]]


def test_the_bodies_carry_them_unchanged_with_string_keys():
    rendered = prompt_logprobs(texts, ENTRIES)
    choice = CompletionChoice(index=0, text="x", prompt_logprobs=rendered)
    assert choice.prompt_logprobs == rendered and type(choice.prompt_logprobs[1][7]) is dict
    expected = [None, {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "<7>"},
                       "3": {"logprob": -2.0, "rank": 2, "decoded_token": "<3>"}},
                {"9": {"logprob": -1.0, "rank": 1, "decoded_token": "<9>"},
                 "2": {"logprob": -1.5, "rank": 2, "decoded_token": "<2>"},
                 "4": {"logprob": -9999.0, "rank": 3, "decoded_token": "<4>"}}]
    assert json.loads(json.dumps(choice.model_dump(mode="json")))["prompt_logprobs"] == expected
    chat = ChatCompletionResponse(id="c", model="m", choices=[], prompt_logprobs=rendered,
                                  usage=UsageInfo(prompt_tokens=3, completion_tokens=0, total_tokens=3))
    assert json.loads(json.dumps(chat.model_dump(mode="json")))["prompt_logprobs"] == expected
