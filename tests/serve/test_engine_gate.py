"""The Ingress's view of whether an engine serves (``EngineWatch``) and the gate that refuses
requests while none does (``EngineGate``), without Ray: the watch's lookups and the app behind the
gate are stand-ins."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from api.errors import OVERLOADED_MESSAGE
from cluster.engine_gate import NO_ENGINE, RETRY_AFTER_S, EngineGate, EngineWatch
from engine import EngineOverloadedError, SamplingParams


class CountingWatch(EngineWatch):
    """An EngineWatch whose lookups answer ``self.up`` engines and are counted."""

    def __init__(self, up: int) -> None:
        super().__init__("app", min_engines=1)
        self.up, self.lookups = up, 0

    def _actors(self) -> dict:
        self.lookups += 1
        return {f"engine:app:{i}": object() for i in range(self.up)}

    async def _ping(self, actor, timeout_s: float) -> bool:
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
        assert await watch.num_up() == 1 and watch.lookups == 2  # answered at once from the last asking,
        await watch._refreshing  # which is asked again meanwhile
        assert watch.lookups == 3

    asyncio.run(run())


def test_while_engines_answer_a_slow_lookup_holds_no_request():
    """Asking the engines again takes long on a busy cluster; while they answered last time, callers
    get that answer at once and the asking goes on in the background."""
    class SlowWatch(CountingWatch):
        def _actors(self) -> dict:
            time.sleep(0.5)
            return super()._actors()

    async def run():
        watch = SlowWatch(up=1)
        assert await watch.num_up() == 1 and watch.lookups == 1  # nothing known yet: waited for
        watch._checked_at -= EngineWatch.PERIOD_S
        started = time.monotonic()
        assert await watch.num_up() == 1
        assert time.monotonic() - started < 0.1
        await watch._refreshing
        assert watch.lookups == 2
        watch.recheck()  # an engine was seen to stop: the next caller waits for the fresh answer
        watch.up = 0
        assert await watch.num_up() == 0 and watch.lookups == 3

    asyncio.run(run())


def test_an_engine_slow_to_answer_while_up_still_counts_and_one_that_fails_does_not():
    """In the background asking while engines are up, an engine that answered before and now gives no
    answer in time is busy, not gone; a starting one (never answered) is not counted, nor one whose
    actor failed, nor a slow one once an engine was seen to stop (callers then wait for the answer)."""
    class ScriptedWatch(CountingWatch):
        answers: dict = {}

        def _actors(self) -> dict:
            self.lookups += 1
            return {name: name for name in self.answers}

        async def _ping(self, actor, timeout_s: float) -> bool | None:
            return self.answers[actor]

    async def run():
        watch = ScriptedWatch(up=0)
        watch.answers = {"engine:app:0": True, "engine:app:1": True}
        assert await watch.num_up() == 2
        # 0 busy, 1 died, 2 starting
        watch.answers = {"engine:app:0": None, "engine:app:1": False, "engine:app:2": None}
        watch._checked_at -= EngineWatch.PERIOD_S
        assert await watch.num_up() == 2  # the last answer, while the background asking runs
        await watch._refreshing
        assert await watch.num_up() == 1 and watch._up_names == {"engine:app:0"}
        watch.recheck()
        assert await watch.num_up() == 0  # waited for: no answer is no engine
        watch.answers = {"engine:app:0": None, "engine:app:2": True}
        watch._checked_at -= EngineWatch.DOWN_PERIOD_S
        assert await watch.num_up() == 1 and watch._up_names == {"engine:app:2"}

    asyncio.run(run())


def gate_client(available: bool, api_key: str | None = None, full: bool | None = None):
    calls = []

    async def app(scope, receive, send):  # stands for the FastAPI app: 401 for a bad key, else 200
        calls.append(scope["path"])
        headers = dict(scope.get("headers", []))
        status = 401 if api_key and headers.get(b"authorization") != f"Bearer {api_key}".encode() else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def is_available() -> bool:
        return available

    async def is_full(inside: int) -> bool:
        return full

    gate = EngineGate(app, is_available, api_key, full=None if full is None else is_full)
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


def test_with_the_engines_full_a_completion_is_refused_before_its_body_is_read():
    """Under a burst, a request Serve's router would refuse is refused at the door, in a millisecond,
    not after its body was parsed and tokenized among every other request's (seconds)."""
    async def run():
        client, calls = gate_client(available=True, full=True)
        async with client:
            refused = [await client.post(path, content=b"{not json") for path in EngineGate.GENERATING]
            models = await client.get("/v1/models")
        for r in refused:
            assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
            assert r.json()["error"] == {"message": OVERLOADED_MESSAGE, "type": "server_error", "param": None,
                                         "code": "engine_overloaded"}
            timings = dict(m.strip().split(";dur=") for m in r.headers["server-timing"].split(","))
            assert set(timings) == {"ingress", "gate"} and 0 <= float(timings["gate"]) <= float(timings["ingress"]) < 100
        assert models.status_code == 200 and calls == ["/v1/models"]

    asyncio.run(run())


def test_the_ingress_is_full_when_its_calls_fill_every_replica_and_the_routers_queue():
    """``ServeEngineClient.full``: calls in flight against replicas x max_ongoing_requests +
    max_queued_requests (the bound past which Serve's router refuses); a full client refuses a request
    without calling the deployment."""
    import serve_app

    class Handle:
        def options(self, **_):
            raise AssertionError("a full Ingress must not call the deployment")

    async def run():
        watch = CountingWatch(up=1)
        client = serve_app.ServeEngineClient(Handle(), watch, limits=(4, 4))
        answers = []
        for up, in_flight in ((1, 7), (1, 8), (2, 8), (2, 11), (2, 12)):
            watch.up, client.in_flight = up, in_flight
            watch.recheck()
            answers.append(await client.full())
        assert answers == [False, True, False, False, True]
        with pytest.raises(EngineOverloadedError, match="every replica is at its queue bound"):
            await client.generate("r", [1, 2], SamplingParams()).__anext__()
        client.in_flight = 0
        assert await client.full(coming=12) and not await client.full(coming=11)  # requests let in count
        unbounded = serve_app.ServeEngineClient(Handle(), watch, limits=(4, -1))
        unbounded.in_flight = 10**6
        assert not await unbounded.full()

    asyncio.run(run())


def test_the_gate_counts_the_requests_it_let_in_until_they_are_answered():
    """A burst passes the gate before any of its requests reached the engines: the gate's own count of
    generating requests inside is what ``full`` weighs then."""
    seen = []
    release = asyncio.Event()

    async def app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def full(inside: int) -> bool:
        seen.append(inside)
        return inside >= 2

    async def available() -> bool:
        return True

    async def run():
        gate = EngineGate(app, available, None, full=full)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gate") as client:
            first = [asyncio.ensure_future(client.post("/v1/completions", json={})) for _ in range(2)]
            while gate.inside < 2:
                await asyncio.sleep(0.001)
            third = await client.post("/v1/chat/completions", json={})
            release.set()
            statuses = [(await r).status_code for r in first]
            assert gate.inside == 0
            fourth = await client.post("/v1/completions", json={})
        return statuses, third, fourth

    statuses, third, fourth = asyncio.run(run())
    assert statuses == [200, 200] and third.status_code == 503 and fourth.status_code == 200
    assert seen == [0, 1, 2, 0]
