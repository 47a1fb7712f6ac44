"""/dashboard/data polls that arrive together share one gathering of the engines' snapshots
(api/dashboard.py), a failed gathering fails the polls that shared it and not the next one, and a
poll that goes away does not cancel the others' (no engine, no model)."""

from __future__ import annotations

import asyncio

import httpx

from api.http_app import build_openai_app

SNAPSHOT = {"time": 1.0, "block_size": 16, "num_blocks": 3, "counts": {"free": 3, "cached": 0, "used": 0, "shared": 0},
            "grid": "f3", "grid_id": "abc", "history": {"t": []}}


class Engines:
    """The app's ``kv_map``: counts its calls, each answered once ``release`` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self.release = asyncio.Event()

    async def __call__(self) -> dict:
        self.calls += 1
        await self.release.wait()
        if self.fail:
            raise RuntimeError("an engine did not answer")
        return {"replica-1": SNAPSHOT}


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")


def test_concurrent_polls_share_one_gathering():
    async def main():
        engines = Engines()
        app = build_openai_app(lambda: None, kv_map=engines)
        async with client(app) as http:
            polls = [asyncio.create_task(http.get("/dashboard/data")) for _ in range(8)]
            await asyncio.sleep(0.05)  # all eight are waiting on the one call
            calls_while_waiting = engines.calls
            engines.release.set()
            bodies = [(await p).json() for p in polls]
            later = await http.get("/dashboard/data")  # after it ended: a call of its own
        return calls_while_waiting, engines.calls, bodies, later.json()

    calls_while_waiting, calls, bodies, later = asyncio.run(main())
    assert calls_while_waiting == 1 and calls == 2
    assert [b["replicas"][0]["grid"] for b in bodies] == ["f3"] * 8 and later["replicas"][0]["replica"] == "replica-1"


def test_a_failed_gathering_fails_its_polls_only_and_a_poll_that_leaves_cancels_nothing():
    async def main():
        engines = Engines()
        app = build_openai_app(lambda: None, kv_map=engines)
        async with client(app) as http:
            engines.fail = True
            polls = [asyncio.create_task(http.get("/dashboard/data")) for _ in range(3)]
            await asyncio.sleep(0.05)
            engines.release.set()
            failed = [(await p).status_code for p in polls]
            engines.fail, engines.release = False, asyncio.Event()
            leaving = asyncio.create_task(http.get("/dashboard/data"))
            staying = asyncio.create_task(http.get("/dashboard/data"))
            await asyncio.sleep(0.05)
            leaving.cancel()
            await asyncio.sleep(0.01)
            engines.release.set()
            return failed, (await staying).status_code, engines.calls

    failed, staying, calls = asyncio.run(main())
    assert failed == [500, 500, 500] and staying == 200 and calls == 2
