"""Clients of the OpenAI-compatible HTTP API that leave have their engine requests aborted. Disconnects need
real sockets (the ASGI transport buffers whole responses): the app runs under uvicorn on an ephemeral port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import openai
import pytest
import uvicorn

from tests.serve.openai_harness import API_KEY, GREEDY, MODEL, app, llm, model_dir, prompts, run, until_clean  # noqa: F401


# --- clients that leave ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def uvicorn_server(app) -> AsyncIterator[str]:
    """The app behind a real socket (the ASGI transport cannot disconnect mid-response)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def test_clients_that_leave_abort_their_engine_requests(app, llm, prompts, run, caplog):
    async def main():
        async with uvicorn_server(app) as url, \
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
            before = llm.stats()["num_generation_tokens"]
            stream = await client.completions.create(model=MODEL, prompt=prompts[1:3], n=2, max_tokens=2000,
                                                     stream=True, **GREEDY)
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 5:
                    break
            await stream.close()  # 2 prompts x 2 samples were running: all must stop
            await until_clean(llm)
            streamed_tokens = llm.stats()["num_generation_tokens"] - before
            with pytest.raises(openai.APITimeoutError):  # a non-streaming client that gives up
                await client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=2000, timeout=0.3,
                                                **GREEDY)
            await until_clean(llm)
            return chunks, streamed_tokens, llm.stats()["num_generation_tokens"] - before - streamed_tokens

    chunks, streamed_tokens, waited_tokens = run(main())
    assert len(chunks) == 5
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "the server logged errors"
    assert streamed_tokens < 4 * 2000 // 2 and waited_tokens < 2000 // 2  # stopped, not run to the end
