"""The proxy benchmark's own servers (benchmarks/overhead/): the zero-latency worker answers OpenAI chat
calls, streamed and not, and the bare passthrough relays them unchanged, as the real `openai` client
sees them. (No timing here: the benchmark measures, tests only check it measures the right thing.)"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import openai
import pytest
from aiohttp import web

from benchmarks.overhead.passthrough import RECORDER, build_app
from benchmarks.overhead.worker import BenchWorker
from serving.threaded_server import free_port

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
async def urls() -> AsyncIterator[tuple[str, str]]:
    worker = BenchWorker()
    worker_url = await worker.start()
    runner = web.AppRunner(build_app(worker_url))
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield worker_url, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await worker.stop()


async def test_worker_and_passthrough_answer_alike(urls: tuple[str, str]) -> None:
    answers = {}
    for name, url in zip(("worker", "passthrough"), urls, strict=True):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = await client.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=5)
        stream = await client.chat.completions.create(
            model="bench", messages=MESSAGES, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(reply.choices[0].message.content or "") == 5
        assert streamed == reply.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
        answers[name] = streamed
        await client.close()
    assert answers["worker"] == answers["passthrough"]


async def test_passthrough_relays_sglang_generate_streams(urls: tuple[str, str]) -> None:
    import aiohttp

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    async with aiohttp.ClientSession() as http:
        bodies = []
        for url in urls:
            async with http.post(f"{url}/generate", json=body) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                bodies.append(await response.read())
    events = [line for line in bodies[0].split(b"\n\n") if line]
    assert len(events) == 5 and events[-1] == b"data: [DONE]"  # 4 cumulative chunks, then DONE
    assert len(bodies[0]) == len(bodies[1])  # same shape (rids differ)


async def test_recording_passthrough_relays_and_records_every_call(empty_db_url: str, tmp_path: Path) -> None:
    """passthrough --sqlite / --postgres (the benchmark's floors for a recording proxy): the same answers,
    streamed and not, and one committed row per call, holding the request and the whole answer."""
    postgres_url = empty_db_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    on_postgres = postgres_url != empty_db_url
    worker = BenchWorker()
    worker_url = await worker.start()
    if on_postgres:
        app = build_app(worker_url, postgres_url=postgres_url)
    else:
        app = build_app(worker_url, str(tmp_path / "calls.db"))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        reply = await client.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=5)
        stream = await client.chat.completions.create(
            model="bench", messages=MESSAGES, max_tokens=5, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == reply.choices[0].message.content and len(streamed) == 5
        recorder = app[RECORDER]
        assert recorder is not None and await recorder.count() == 2
        if on_postgres:
            connection = await asyncpg.connect(postgres_url)
            try:
                rows = await connection.fetch("SELECT response FROM calls")
            finally:
                await connection.close()
        else:
            rows = sqlite3.connect(tmp_path / "calls.db").execute("SELECT response FROM calls").fetchall()
        assert any(b"data: [DONE]" in row[0] for row in rows)  # the stream's whole answer, last piece too
    finally:
        await client.close()
        await runner.cleanup()
        await worker.stop()
