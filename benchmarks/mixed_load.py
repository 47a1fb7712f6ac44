"""The soak's mixed load: completions and chat, unary and streamed, a fifth of the streams cut by
the client after their first chunk (a client that leaves: the server must abort the request and free
its blocks).

Client ``i`` sends request ``n`` of kind ``KINDS[(i + n) % 5]``: over any five consecutive requests
of a client, one of each. Of the three streamed kinds one is cut, and a cut stream is counted ok
when its first chunk arrived with status 200 (what happens after the cut is the server's business:
``num_blocks_in_use`` at the end says whether it cleaned up)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.chaos import MODEL_NAME, RETRY_PAUSE_S, Load, Record, _error_code, _error_message

KINDS = ("completion", "completion_stream", "chat", "chat_stream", "completion_stream_cut")


class MixedLoad(Load):
    """``concurrency`` clients, each cycling through ``KINDS``; a record that is ok carries its kind in
    ``code`` (which holds the error's code otherwise)."""

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            kind = KINDS[(i + n) % len(KINDS)]
            start = self.open[i] = time.monotonic()
            try:
                record = await self._one(kind, i, n, start)
            except httpx.HTTPError as exc:
                record = Record(start, time.monotonic(), False, type(exc).__name__, stream="stream" in kind)
            if record.ok:
                record.code = kind
            self.records.append(record)
            del self.open[i]
            if not record.ok:
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _one(self, kind: str, i: int, n: int, start: float) -> Record:
        text = f"A shared preamble for every client. Client {i}, request {n}:"
        common = {"model": MODEL_NAME, "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        if kind.startswith("chat"):
            path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {**common, "prompt": text}
        if kind == "completion_stream_cut":
            return await self._cut(path, {**body, "stream": True}, start)
        if kind.endswith("stream"):
            return await self._streamed(body, start, path)
        return await self._unary(body, start, path)

    async def _cut(self, path: str, body: dict, start: float) -> Record:
        """Read the first data chunk, then close the connection."""
        async with self._http.stream("POST", f"{self.url}{path}", json=body) as r:
            if r.status_code != 200:
                content = await r.aread()
                return Record(start, time.monotonic(), False, r.status_code, _error_code(content), True,
                              _error_message(content))
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    ok = line[6:] != "[DONE]" and "error" not in json.loads(line[6:])
                    return Record(start, time.monotonic(), ok, 200, None if ok else "error_chunk", True)
        return Record(start, time.monotonic(), False, 200, "no_chunk", True)
