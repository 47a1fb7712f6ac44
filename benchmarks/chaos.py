"""`kvserve chaos`: the Serve app under faults (and what `kvserve soak`, benchmarks/soak.py, shares
with it: the app's start and stop, the load, the report).

Both start the app the way `serve run` does on this machine: a local Ray cluster with the CPUs Ray
finds here (no logical CPUs added), Serve's HTTP proxy on a free port, `serve_app.build_app`. A load
of completions runs at a fixed concurrency, each client sending its next request when the last one
ended (0.2 s later after a failure); every request is recorded (start, end, status, error code).

chaos, one fault after another, each once the app serves steadily again:

    scheduler   ray.kill of the replica's scheduler actor (`engine:<app>:<replica>`)
    rank        SIGKILL of tensor-parallel rank 1's process (needs tensor_parallel_size >= 2)
    replica     ray.kill of the LLMServer replica actor (Serve starts another)

and reports for each: the requests in flight at the fault that did not complete (lost), the requests
sent after it that were refused (their statuses and error codes), those that got no answer within
the client timeout (hung), the seconds from the fault until a request sent after it completed
(recovery), the error messages those requests read, and any of them that shows internals (leaked:
Ray's exception names, actor ids, pids, addresses, tracebacks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass

import httpx

APP = "kvserve"
MODEL_NAME = "chaos"
FAULTS = ("scheduler", "rank", "replica")
RETRY_PAUSE_S = 0.2


@dataclass
class Record:
    start: float
    end: float
    ok: bool
    status: int | str  # HTTP status, or the client-side exception's name ("ReadTimeout": hung)
    code: str | None = None  # the OpenAI error body's code
    stream: bool = False
    message: str | None = None  # the OpenAI error body's message


# what an error message must not show a client: Ray's exception names, actor ids, pids, addresses, tracebacks
INTERNALS = re.compile(r"ActorDiedError|RayActorError|RayTaskError|actor_id|\bpid\b|\b[0-9a-f]{32}\b|"
                       r"\b\d{1,3}(?:\.\d{1,3}){3}\b|Traceback|ray::")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset, built if missing)")
    parser.add_argument("--concurrency", type=int, default=4, help="clients sending requests back to back")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (EOS ignored)")
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout: a request without an "
                        "answer by then counts as hung")
    parser.add_argument("--app-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument of the app, as `serve run serve_app:app KEY=VALUE` takes it (repeat)")
    parser.add_argument("--out", help="write the report here as JSON")


def app_args(pairs: list[str]) -> dict[str, str]:
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--app-arg takes KEY=VALUE, got {pair!r}")
        args[key] = value
    return args


def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds of steady load before each fault")
    parser.add_argument("--recovery-timeout", type=float, default=120.0,
                        help="seconds to wait for a completion after a fault before giving up on it")


# --- the app -------------------------------------------------------------------------------------


def start_app(model: str | None, tensor_parallel_size: int, **extra) -> str:
    """A fresh local Ray cluster with this machine's CPUs, Serve on a free port, the app; its URL."""
    import ray
    from ray import serve

    from cluster.serve_env import free_port
    from serve_app import build_app, serve_env

    serve_env()  # Serve's settings, in this process before Ray starts, as `serve run serve_app:app` has them
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": model, "served_model_name": MODEL_NAME, "tensor_parallel_size": tensor_parallel_size,
            "max_num_seqs": 16, **extra}
    serve.run(build_app(args), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_app() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _named(namespace: str, prefix: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith(prefix))


def engine_actor():
    import ray

    names = _named("kvserve", f"engine:{APP}:")
    if len(names) != 1:
        raise RuntimeError(f"expected one engine of {APP}, found {names}")
    return ray.get_actor(names[0], namespace="kvserve")


def engine_stats() -> dict:
    import ray

    return ray.get(engine_actor().stats.remote(), timeout=30)


def inject(fault: str) -> tuple[str, float]:
    """Cause ``fault``; returns what was killed and when (``time.monotonic()`` just before the kill: finding
    the actor takes a while, a second or more on a loaded machine, in which requests may end)."""
    import ray

    if fault == "scheduler":
        actor = engine_actor()
        killed_at = time.monotonic()
        ray.kill(actor, no_restart=True)
        return "scheduler actor", killed_at
    if fault == "rank":
        pids = ray.get(engine_actor().worker_pids.remote(), timeout=30)
        if len(pids) < 2:
            raise RuntimeError("the rank fault needs tensor_parallel_size >= 2")
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        return f"rank 1 (pid {pids[1]})", killed_at
    if fault == "replica":
        [name] = _named("serve", f"SERVE_REPLICA::{APP}#LLMServer#")
        replica = ray.get_actor(name, namespace="serve")
        killed_at = time.monotonic()
        ray.kill(replica, no_restart=True)
        return "LLMServer replica", killed_at
    raise ValueError(f"unknown fault {fault!r}")


# --- the load ------------------------------------------------------------------------------------


class Load:
    """``concurrency`` clients sending completions back to back until stopped; odd clients stream."""

    def __init__(self, url: str, concurrency: int, max_tokens: int, timeout: float) -> None:
        self.url, self.concurrency, self.max_tokens, self.timeout = url, concurrency, max_tokens, timeout
        self.records: list[Record] = []
        self.open: dict[int, float] = {}  # client -> start of the request it waits for
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=self.concurrency))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": MODEL_NAME, "prompt": f"A shared preamble for every client. Client {i}, request {n}:",
                    "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
            start = self.open[i] = time.monotonic()
            try:
                record = await (self._streamed(body, start) if i % 2 else self._unary(body, start))
            except httpx.HTTPError as exc:
                record = Record(start, time.monotonic(), False, type(exc).__name__, stream=bool(i % 2))
            self.records.append(record)
            del self.open[i]
            if not record.ok:
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _unary(self, body: dict, start: float, path: str = "/v1/completions") -> Record:
        r = await self._http.post(f"{self.url}{path}", json=body)
        if r.status_code == 200:
            ok = r.json()["usage"]["completion_tokens"] == self.max_tokens
            return Record(start, time.monotonic(), ok, 200, None if ok else "wrong_token_count")
        return Record(start, time.monotonic(), False, r.status_code, _error_code(r.content),
                      message=_error_message(r.content))

    async def _streamed(self, body: dict, start: float, path: str = "/v1/completions") -> Record:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        events = []
        async with self._http.stream("POST", f"{self.url}{path}", json=body) as r:
            if r.status_code != 200:
                content = await r.aread()
                return Record(start, time.monotonic(), False, r.status_code, _error_code(content), True,
                              _error_message(content))
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        end = time.monotonic()
        if events[-1:] != ["[DONE]"]:
            return Record(start, end, False, 200, "unfinished_stream", True)
        last = json.loads(events[-2]) if len(events) >= 2 else {}
        if "error" in last:
            return Record(start, end, False, 200, last["error"].get("code"), True, last["error"].get("message"))
        ok = (last.get("usage") or {}).get("completion_tokens") == self.max_tokens
        return Record(start, end, ok, 200, None if ok else "wrong_token_count", True)

    def first_success_after(self, t: float) -> Record | None:
        done = [r for r in self.records if r.ok and r.start >= t]
        return min(done, key=lambda r: r.end) if done else None


def _error_code(content: bytes) -> str | None:
    try:
        return json.loads(content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _error_message(content: bytes) -> str | None:
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None


def _messages(records: list[Record]) -> dict[str, int]:
    return dict(Counter(r.message for r in records if r.message is not None))


def _outcomes(records: list[Record]) -> dict[str, int]:
    return dict(Counter("ok" if r.ok else f"{r.status} {r.code or ''}".strip() for r in records))


# --- chaos ---------------------------------------------------------------------------------------


async def _chaos(url: str, faults: list[str], concurrency: int, max_tokens: int, timeout: float, settle: float,
                 recovery_timeout: float) -> list[dict]:
    loop = asyncio.get_running_loop()
    load = Load(url, concurrency, max_tokens, timeout)
    load.start()
    results = []
    try:
        for fault in faults:
            # steady first: `settle` seconds in which every request that ended succeeded
            calm_since = time.monotonic()
            while time.monotonic() - calm_since < settle:
                await asyncio.sleep(0.5)
                if any(not r.ok and r.end >= calm_since for r in load.records):
                    calm_since = time.monotonic()
            what, t_fault = await loop.run_in_executor(None, inject, fault)  # in flight: running at the kill
            print(f"[chaos] {fault}: killed the {what}", flush=True)
            deadline = t_fault + recovery_timeout
            while (first := load.first_success_after(t_fault)) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await _wait_in_flight(load, t_fault, deadline=time.monotonic() + timeout + 5)
            in_flight = [r for r in load.records if r.start <= t_fault <= r.end]
            after = [r for r in load.records if r.start > t_fault and (first is None or r.start <= first.end)]
            result = {
                "fault": fault, "killed": what,
                "recovery_s": None if first is None else round(first.end - t_fault, 2),
                "in_flight": len(in_flight),
                "lost": sum(not r.ok for r in in_flight),
                "in_flight_outcomes": _outcomes(in_flight),
                "refused": sum(not r.ok for r in after),
                "refused_outcomes": _outcomes([r for r in after if not r.ok]),
                "hung": sum(isinstance(r.status, str) and "Timeout" in r.status
                            for r in in_flight + after),
                # what the failed requests read, and those of it that show internals (should be none)
                "error_messages": _messages(in_flight + after),
                "leaked": sorted({r.message for r in in_flight + after if r.message and INTERNALS.search(r.message)}),
            }
            print(f"[chaos] {fault}: recovery {result['recovery_s']} s, lost {result['lost']} of "
                  f"{result['in_flight']} in flight, refused {result['refused']} {result['refused_outcomes']}, "
                  f"hung {result['hung']}", flush=True)
            results.append(result)
    finally:
        await load.stop()
    return results


async def _wait_in_flight(load: Load, t: float, deadline: float) -> None:
    """Until every request in flight at ``t`` has ended (and been recorded)."""
    while any(start <= t for start in load.open.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def run_chaos(model: str | None = None, faults: list[str] = list(FAULTS), tensor_parallel_size: int = 2,
              concurrency: int = 4, max_tokens: int = 16, timeout: float = 60.0, settle: float = 5.0,
              recovery_timeout: float = 120.0, **app_args) -> dict:
    if "rank" in faults and tensor_parallel_size < 2:
        raise ValueError("the rank fault needs --tensor-parallel-size 2 or more")
    started = time.monotonic()
    url = start_app(model, tensor_parallel_size, **app_args)
    print(f"[chaos] the app serves at {url} after {time.monotonic() - started:.1f}s", flush=True)
    try:
        results = asyncio.run(_chaos(url, faults, concurrency, max_tokens, timeout, settle, recovery_timeout))
        stats = _settled_stats()
    finally:
        stop_app()
    return {"tensor_parallel_size": tensor_parallel_size, "concurrency": concurrency, "max_tokens": max_tokens,
            "faults": results, "num_blocks_in_use_at_end": stats["num_blocks_in_use"],
            "num_requests_running_at_end": stats["num_requests_running"]}


def _settled_stats(timeout_s: float = 30.0) -> dict:
    """The engine's stats once nothing runs or waits (the load has stopped; aborts land in a step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats()
        if (stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def run_chaos_command(args: argparse.Namespace) -> int:
    report = run_chaos(args.model, args.faults, args.tensor_parallel_size, args.concurrency, args.max_tokens,
                       args.timeout, args.settle, args.recovery_timeout, **app_args(args.app_arg))
    _write(report, args.out)
    return 0


def _write(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)

