"""/metrics and /dashboard/data ask every engine of the app (``Ingress._ask_engines``): Ray's lookups
of the engines (GCS calls that block) run on a thread, so the Ingress's event loop serves other
requests meanwhile, and their answer is kept a second, so scrapes in a loop do not repeat them. Ray's
lookups are stand-ins here that take 0.5 s."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import ray

from cluster.engine_gate import EngineWatch
from serve_app import Ingress

LOOKUP_S = 0.5


class Engine:
    """A scheduler actor's handle: ``stats.remote()`` answers at once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = SimpleNamespace(remote=self._stats)

    async def _stats(self) -> dict:
        return {"engine": self.name}


def test_the_engines_are_looked_up_off_the_event_loop_and_kept_a_second(monkeypatch):
    lookups = []

    def list_named_actors(all_namespaces=False):
        lookups.append(time.monotonic())
        time.sleep(LOOKUP_S)  # a slow GCS
        return [{"namespace": "kvserve", "name": "engine:app:r0"}, {"namespace": "kvserve", "name": "engine:app:r1"},
                {"namespace": "kvserve", "name": "engine:other:r0"}, {"namespace": "serve", "name": "engine:app:x"}]

    def get_actor(name, namespace=None):
        time.sleep(0.05)
        return Engine(name)

    monkeypatch.setattr(ray.util, "list_named_actors", list_named_actors)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    ingress = SimpleNamespace(app_name="app", engines=EngineWatch("app", min_engines=1))

    async def main():
        ticks = 0

        async def ticker():  # another request's work on the loop
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        started = time.monotonic()
        first = await Ingress._ask_engines(ingress, "stats")
        took = time.monotonic() - started
        ticks_meanwhile = ticks
        again = await Ingress._ask_engines(ingress, "stats")  # within the second: no lookup
        task.cancel()
        return first, again, took, ticks_meanwhile

    first, again, took, ticks = asyncio.run(main())
    assert first == again == {"r0": {"engine": "engine:app:r0"}, "r1": {"engine": "engine:app:r1"}}
    assert ticks >= 20, f"the loop ran {ticks} ticks of 10 ms in {took:.2f}s"  # about 55 when not blocked
    assert took >= LOOKUP_S and len(lookups) == 1
