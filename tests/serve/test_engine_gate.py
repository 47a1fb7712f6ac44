"""The Ingress's view of whether an engine serves (``EngineWatch``) and the gate that refuses
requests while none does (``EngineGate``), without Ray: the watch's lookups and the app behind the
gate are stand-ins."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster.engine_gate import NO_ENGINE, RETRY_AFTER_S, EngineGate, EngineWatch


class CountingWatch(EngineWatch):
    """An EngineWatch whose lookups answer ``self.up`` engines and are counted."""

    def __init__(self, up: int) -> None:
        super().__init__("app", min_engines=1)
        self.up, self.lookups = up, 0

    def _actors(self) -> dict:
        self.lookups += 1
        return {f"engine:app:{i}": object() for i in range(self.up)}

    async def _ping(self, actor) -> bool:
        return True


def test_the_watch_asks_again_sooner_while_no_engine_answers():
    def age(watch, seconds):  # the last lookup, ``seconds`` longer ago
        watch._checked_at -= seconds

    async def run():
        watch = CountingWatch(up=0)
        assert await watch.num_up() == 0 and watch.lookups == 1
        age(watch, EngineWatch.DOWN_PERIOD_S / 2)
        assert await watch.num_up() == 0 and watch.lookups == 1  # still fresh
        watch.up = 1
        age(watch, EngineWatch.DOWN_PERIOD_S)  # past the short period: asked again, the engine is back
        assert await watch.num_up() == 1 and watch.lookups == 2
        assert EngineWatch.DOWN_PERIOD_S * 3 < EngineWatch.PERIOD_S
        age(watch, EngineWatch.DOWN_PERIOD_S * 3)  # with an engine up, the long period holds
        assert await watch.num_up() == 1 and watch.lookups == 2
        age(watch, EngineWatch.PERIOD_S)
        assert await watch.num_up() == 1 and watch.lookups == 3

    asyncio.run(run())


def gate_client(available: bool, api_key: str | None = None):
    calls = []

    async def app(scope, receive, send):  # stands for the FastAPI app: 401 for a bad key, else 200
        calls.append(scope["path"])
        headers = dict(scope.get("headers", []))
        status = 401 if api_key and headers.get(b"authorization") != f"Bearer {api_key}".encode() else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def is_available() -> bool:
        return available

    gate = EngineGate(app, is_available, api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gate"), calls


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_with_no_engine_a_completion_is_refused_before_its_body_is_read(path):
    async def run():
        client, calls = gate_client(available=False)
        async with client:
            r = await client.post(path, content=b"{not json")  # the app would answer 400 to this
        assert r.status_code == 503 and calls == []
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert r.json()["error"] == {"message": NO_ENGINE, "type": "server_error", "param": None,
                                     "code": "engine_unavailable"}

    asyncio.run(run())


def test_the_gate_lets_through_what_it_does_not_refuse():
    async def run():
        client, calls = gate_client(available=False, api_key="sk-right")
        async with client:
            wrong_key = await client.post("/v1/completions", json={}, headers={"authorization": "Bearer sk-wrong"})
            tokenize = await client.post("/tokenize", json={}, headers={"authorization": "Bearer sk-right"})
            health = await client.get("/health")
        assert wrong_key.status_code == 401  # a bad key hears it is bad, not that the engine is away
        assert tokenize.status_code == 200  # needs no engine
        assert health.status_code == 503
        assert calls == ["/v1/completions", "/tokenize"]
        client, calls = gate_client(available=True)
        async with client:
            assert (await client.post("/v1/completions", json={})).status_code == 200
        assert calls == ["/v1/completions"]

    asyncio.run(run())
