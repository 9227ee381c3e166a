"""Nothing lost: `kill -9` the proxy while agents are running; after a restart every completion any
client received is in the database, complete, and the proxy serves again."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import openai
import pytest
from sqlalchemy import select

from flywheel.processes import flywheel_command, start_child
from flywheel.stack import wait_healthy
from storage.config import StorageConfig
from storage.engine import create_engine, create_sessionmaker
from storage.models import Completion
from tests.support.stack import rest, running_stack, stack_overrides, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENTS = 4


def agent_loop(root_url: str, key: str, received: dict[str, str], stop: threading.Event) -> None:
    client = openai.OpenAI(base_url=f"{root_url}/v1", api_key=key, max_retries=0, timeout=30)
    turn = 0
    while not stop.is_set():
        turn += 1
        try:
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=16,
                stream=turn % 2 == 0,
            )
        except (openai.APIConnectionError, openai.APIStatusError):
            time.sleep(0.05)  # the proxy is down: an agent retries later
            continue
        if turn % 2 == 0:
            chunks, completion_id = [], None
            try:
                for chunk in answer:
                    completion_id = chunk.id
                    chunks.extend(choice.delta.content or "" for choice in chunk.choices)
            except (openai.APIConnectionError, openai.APIError, Exception):
                continue  # a stream cut by the kill was never fully received
            received[completion_id] = "".join(chunks)
        else:
            received[answer.id] = answer.choices[0].message.content or ""


async def recorded(db_url: str) -> dict[str, Completion]:
    engine = create_engine(StorageConfig(url=db_url))
    try:
        async with create_sessionmaker(engine)() as session:
            return {row.id: row for row in (await session.scalars(select(Completion))).all()}
    finally:
        await engine.dispose()


def test_kill_9_loses_no_received_completion(empty_db_url, tiny_model_dir, tmp_path):
    overrides = stack_overrides(empty_db_url, tiny_model_dir, tmp_path / "run")
    with running_stack(overrides, trainer=False) as stack:
        with rest(stack.root_url, stack.admin_key) as admin:
            keys = [admin.post("/rl/v1/sessions", json={}).json()["api_key"] for _ in range(AGENTS)]
        received: dict[str, str] = {}
        stop = threading.Event()
        agents = [
            threading.Thread(target=agent_loop, args=(stack.root_url, key, received, stop)) for key in keys
        ]
        for thread in agents:
            thread.start()
        wait_for(lambda: len(received) >= 12, 120, "agents to receive completions", stack)
        proxy = next(child for child in stack.children if child.name == "proxy")
        proxy.process.send_signal(signal.SIGKILL)
        proxy.process.wait()
        time.sleep(1.0)  # agents keep trying against the dead proxy
        argv = flywheel_command("proxy", None, overrides)
        restarted = start_child("proxy", argv, tmp_path / "run" / "logs")
        stack.children[stack.children.index(proxy)] = restarted
        asyncio.run(wait_healthy(restarted, f"{stack.root_url}/health", timeout_s=120))
        before_restart = len(received)
        wait_for(lambda: len(received) >= before_restart + 4, 120, "agents served after restart", stack)
        stop.set()
        for thread in agents:
            thread.join(60)

    rows = asyncio.run(recorded(empty_db_url))
    missing = set(received) - set(rows)
    assert not missing, f"{len(missing)} completions were received but not recorded"
    for completion_id in received:
        row = rows[completion_id]
        assert len(row.prompt_ids) > 0
        assert len(row.output_ids) == len(row.output_logprobs) == len(row.output_versions)
        assert row.response_json["id"] == completion_id
    for row in rows.values():  # no half-written rows, whether or not a client saw them
        assert len(row.output_ids) == len(row.output_logprobs) == len(row.output_versions)
        assert row.request_json and row.response_json
