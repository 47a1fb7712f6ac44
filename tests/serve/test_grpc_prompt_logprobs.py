"""gRPC's prompt_logprobs and truncate_prompt_tokens (api/grpc_serving.py), on the server of
tests/serve/grpc_harness.py: the engine's values in the proto's shape, unary and streamed; a truncated
prompt answers as the truncated prompt does."""

from __future__ import annotations

import grpc
import pytest

from tests.serve.grpc_harness import GREEDY, TIMEOUT_S, model_dir, offline, reference, request, server  # noqa: F401

PROMPT = [5, 17, 300, 41, 9, 77, 120]


def test_prompt_logprobs_as_the_engine_computes_them(server, offline):  # noqa: F811
    expected = reference(offline, PROMPT, **GREEDY, prompt_logprobs=2).prompt_logprobs
    unary = server.stub.Generate(request(PROMPT, **GREEDY, prompt_logprobs=2), timeout=TIMEOUT_S)
    streamed = list(server.stub.GenerateStream(request(PROMPT, **GREEDY, prompt_logprobs=2), timeout=TIMEOUT_S))
    assert [len(m.prompt_logprobs) for m in streamed].count(len(PROMPT) - 1) == 1  # on one message
    assert sum(len(m.prompt_logprobs) for m in streamed) == len(PROMPT) - 1
    got = next(m for m in streamed if m.prompt_logprobs).prompt_logprobs
    assert list(unary.prompt_logprobs) == list(got)
    for message, token_id, entry in zip(got, PROMPT[1:], expected[1:]):
        assert message.token_id == token_id
        assert (message.logprob, message.rank) == (pytest.approx(entry[token_id][0]), entry[token_id][1])
        top = sorted(((r, t) for t, (_, r) in entry.items() if r <= 2))
        assert [t.token_id for t in message.top] == [t for _, t in top][:2] and len(message.top) == 2
    plain = server.stub.Generate(request(PROMPT, **GREEDY), timeout=TIMEOUT_S)
    assert len(plain.prompt_logprobs) == 0


def test_truncate_prompt_tokens_answers_as_the_cut_prompt(server):  # noqa: F811
    cut = server.stub.Generate(request(PROMPT, **GREEDY, truncate_prompt_tokens=3), timeout=TIMEOUT_S)
    sent = server.stub.Generate(request(PROMPT[-3:], **GREEDY), timeout=TIMEOUT_S)
    assert cut.usage.prompt_tokens == 3
    assert list(cut.completions[0].token_ids) == list(sent.completions[0].token_ids)
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(request(PROMPT, **GREEDY, truncate_prompt_tokens=0), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "truncate_prompt_tokens must be at least 1, got 0"
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(request(PROMPT, **GREEDY, prompt_logprobs=21), timeout=TIMEOUT_S)
    assert info.value.details() == "prompt_logprobs must be at most 20 (the engine's max_logprobs), got 21"
