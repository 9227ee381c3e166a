"""`kill -9` of a `flywheel rewards run` process with hook jobs in flight loses and doubles nothing: after a
restart every session has exactly one reward from its hook (counted in the database), though some jobs ran
twice (their first run died with the process)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from rewards.hooks.spec import HookSpec, stored_hooks
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import JobState, Reward, RewardJob
from storage.queries import create_session, end_session, record_completions
from storage.records import CompletionRecord, SessionRecord
from tests.support.databases import storage_config, storage_overrides

pytestmark = pytest.mark.slow

SESSIONS = 12


async def _sessions_with_ended_hooks(session_factory: SessionFactory) -> list[str]:
    spec = HookSpec(hook="tests.support.reward_functions:slow_marked", name="slow", args={"seconds": 0.4})
    hooks = stored_hooks([spec], default_max_attempts=5)
    ids = [f"sess-durable-{i}" for i in range(SESSIONS)]
    for session_id in ids:
        await create_session(session_factory, SessionRecord(id=session_id, key_hash=secrets.token_hex(32),
                                                            reward_hooks=hooks))
        await record_completions(session_factory, [CompletionRecord(
            id=f"chatcmpl-{session_id}", session_id=session_id, parent_id=None, prompt_ids=[1, 2],
            output_ids=[3], output_logprobs=np.zeros(1, np.float32), output_versions=[0],
            finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1, request_json={"messages": []},
            response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]},
        )])
        assert await end_session(session_factory, session_id)
    return ids


def _runner(db_url: str, log: Path) -> subprocess.Popen[bytes]:
    overrides = [*storage_overrides(db_url), "rewards.runner.concurrency=4", "rewards.runner.workers=2",
                 "rewards.runner.poll_interval_s=0.1", "rewards.runner.timeout_s=20",
                 # At the default niceness a saturated machine (the rest of the suite) starves the workers
                 # as they start; the test is about a kill, not about priorities.
                 "rewards.runner.worker_nice=0",
                 "rewards.runner.lease_margin_s=1"]
    env = {**os.environ, "FLYWHEEL_TEST_HOOK_LOG": str(log), "RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen([sys.executable, "-m", "flywheel.cli", "rewards", "run", *overrides], env=env,
                            start_new_session=True)  # its own process group: kill -9 takes its workers too


async def _wait(probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_kill_9_of_the_runner_loses_and_doubles_no_reward(db_url: str, tmp_path: Path) -> None:
    engine = create_engine(storage_config(db_url))
    session_factory = create_sessionmaker(engine)
    log = tmp_path / "runs.log"
    log.touch()
    try:
        ids = await _sessions_with_ended_hooks(session_factory)

        async def running() -> bool:
            async with session_factory() as db:
                busy = await db.scalar(select(func.count()).where(RewardJob.state == JobState.RUNNING.value))
                return bool(busy and busy >= 2 and log.read_text().count("\n") >= 2)

        first = _runner(db_url, log)
        try:
            await _wait(running, 240)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()

        async def all_done() -> bool:
            async with session_factory() as db:
                query = select(func.count()).where(RewardJob.state != JobState.DONE.value)
                open_jobs = await db.scalar(query)
                return open_jobs == 0

        second = _runner(db_url, log)
        try:
            await _wait(all_done, 360)
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=60)

        async with session_factory() as db:
            query = select(Reward.session_id).where(Reward.source == "hook:slow")
            rewards = Counter((await db.execute(query)).scalars())
            attempts = list((await db.execute(select(RewardJob.attempts))).scalars())
        assert rewards == Counter({session_id: 1 for session_id in ids})  # every session, exactly once
        runs = Counter(log.read_text().split())
        assert any(attempt >= 2 for attempt in attempts) or any(n >= 2 for n in runs.values()), (
            "no job was interrupted: the test did not exercise the kill"
        )
    finally:
        await engine.dispose()

