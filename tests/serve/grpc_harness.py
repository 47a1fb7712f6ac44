"""The gRPC tests' harness: the KVServe service on a plain grpc.aio server over an in-process AsyncLLM (and a
second one with an API key) on a background event loop, the offline LLM it is judged against, and helpers."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from api import grpc_serving
from api import kvserve_pb2 as pb
from api import kvserve_pb2_grpc
from api.engine_client import AsyncLLMClient
from engine import LLM, AsyncLLM, SamplingParams, engine_config
from engine.messages import CompletionOutput, RequestOutput

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


API_KEY = "sk-grpc-test"


class Server(NamedTuple):
    """The running server, its engine, and a blocking stub on a channel to it; a second server on the
    same engine is configured with ``API_KEY``."""

    address: str
    engine: AsyncLLM
    stub: kvserve_pb2_grpc.KVServeStub
    keyed_stub: kvserve_pb2_grpc.KVServeStub
    keyed_address: str


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model=model_dir, num_kv_blocks=300) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=300))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()

    async def start(api_key: str | None) -> tuple[grpc.aio.Server, int]:
        grpc_server = grpc.aio.server()
        servicer = grpc_serving.KVServeServicer(AsyncLLMClient(engine), engine.core.tokenizer, api_key)
        kvserve_pb2_grpc.add_KVServeServicer_to_server(servicer, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(None), loop).result(TIMEOUT_S)
    keyed_server, keyed_port = asyncio.run_coroutine_threadsafe(start(API_KEY), loop).result(TIMEOUT_S)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel, grpc.insecure_channel(f"127.0.0.1:{keyed_port}") as keyed:
        yield Server(address, engine, kvserve_pb2_grpc.KVServeStub(channel), kvserve_pb2_grpc.KVServeStub(keyed),
                     f"127.0.0.1:{keyed_port}")
    for running in (grpc_server, keyed_server):
        asyncio.run_coroutine_threadsafe(running.stop(None), loop).result(TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(TIMEOUT_S)
    engine.shutdown()


def request(prompt: str | list[int], request_id: str = "", **params) -> pb.GenerateRequest:
    prompt_field = {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=prompt)}
    return pb.GenerateRequest(**prompt_field, params=pb.SamplingParameters(**params), request_id=request_id)


def reference(offline, prompt: str | list[int], **params) -> RequestOutput:
    inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return offline.generate(inputs, SamplingParams(**params))[0]


def wait_until_clean(engine: AsyncLLM, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats["num_requests_running"] == stats["num_blocks_in_use"] == stats["num_requests_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
        time.sleep(0.01)


def assert_matches(completion: pb.Completion, expected: CompletionOutput) -> None:
    assert (completion.text, list(completion.token_ids)) == (expected.text, expected.token_ids)
    assert completion.finish_reason == expected.finish_reason


def merge_stream(messages: list[pb.GenerateResponse]) -> dict[int, tuple[str, list[int], str]]:
    merged: dict[int, tuple[str, list[int], str]] = {}
    for message in messages:
        for c in message.completions:
            text, ids, reason = merged.get(c.index, ("", [], ""))
            merged[c.index] = (text + c.text, ids + list(c.token_ids), c.finish_reason or reason)
    return merged
