"""Shared by the OpenAI HTTP tests: the real FastAPI app over an in-process AsyncLLM on the tiny llama,
the official ``openai`` client and raw httpx on the ASGI transport, the offline ``LLM`` as reference.

Import the fixtures into a test module; they are module-scoped, so each module gets one engine, and
everything runs on one event loop per module (``run``), the engine's step loop included.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from api.http_app import build_openai_app
from api.metrics import prometheus_text
from api.openai_serving import AsyncLLMClient, OpenAIServing
from engine import LLM, AsyncLLM, SamplingParams, engine_config
from engine.tokenizer import Tokenizer
from tests.e2e.prompts import test_prompts as make_prompts

MODEL = "tiny-llama"
API_KEY = "sk-test"
REPLICA = "0"  # the replica label of the in-process engine's /metrics series
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return make_prompts(model_dir)


@pytest.fixture(scope="module")
def run():
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture(scope="module")
def llm(model_dir, run):  # after `run`: shut down before the loop closes
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=400))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model=model_dir, num_kv_blocks=400) as reference:
        yield reference


@pytest.fixture(scope="module")
def app(llm, model_dir):
    serving = OpenAIServing(AsyncLLMClient(llm), Tokenizer(model_dir), MODEL, llm.core.config.max_model_len)

    async def metrics_text() -> str:  # what the Serve app exposes, for its one replica
        return prometheus_text({REPLICA: llm.stats()}, MODEL)

    return build_openai_app(lambda: serving, api_key=API_KEY, metrics_text=metrics_text)


@pytest.fixture(scope="module")
def client(app, run) -> openai.AsyncOpenAI:
    """The official client, in process (no retries: a failure must show as it is)."""
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    yield openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=transport, max_retries=0)
    run(transport.aclose())


@pytest.fixture(scope="module")
def http(app, run) -> httpx.AsyncClient:
    """Raw HTTP, authorized; pass ``headers=`` to override."""
    raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                            headers={"Authorization": f"Bearer {API_KEY}"})
    yield raw
    run(raw.aclose())


def reference(offline, prompt, **params):
    """The offline LLM's output for a text or token-id prompt."""
    inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return offline.generate(inputs, SamplingParams(**params))[0].outputs[0]


async def until_clean(llm, timeout_s: float = 10.0) -> None:
    """Wait until the engine holds no request and no KV block."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = llm.stats()
        if stats["num_requests_running"] == 0 and stats["num_blocks_in_use"] == 0 \
                and stats["num_requests_waiting"] == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"engine not clean: {stats}"
        await asyncio.sleep(0.01)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response has ``status`` and an OpenAI error body naming ``param``; returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


def parse_metrics(text: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """The Prometheus exposition, read by prometheus_client's parser: family name -> (type,
    {(sample name, sorted labels): value}). Raises on text the parser refuses."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = (family.type, samples)
    return families
