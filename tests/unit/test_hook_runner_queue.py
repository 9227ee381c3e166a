"""The hook runner's per-job timeout counts run time only: a job whose grader waits in the process pool behind
other jobs' (more jobs at once than workers) is not charged for the wait, and its lease is kept while it
waits. Also the wait clock itself, on a fake clock."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import select

from rewards.config import HookRunnerConfig
from rewards.hooks.pool import ProcessHookPool, WaitClock
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec, stored_hooks
from rewards.runner import HookRunner, job_time_cap
from storage.engine import SessionFactory
from storage.models import JobState, Reward, RewardJob
from storage.queries import create_session, end_session
from storage.records import SessionRecord

JOBS = 3
RUN_S = 1.5
"""What each grader takes: most of its TIMEOUT_S, so that any job queued behind another one would pass its
limit if the wait counted."""
TIMEOUT_S = 2.5


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_stops_while_an_item_waits_and_none_runs() -> None:
    time = FakeTime()
    clock = WaitClock(time)
    time.now += 1.0
    clock.queued()
    assert clock.waiting
    time.now += 5.0
    assert (clock.elapsed(), clock.waited(), clock.run_time()) == (6.0, 5.0, 1.0)
    clock.started()
    time.now += 2.0
    clock.queued()  # a second item waits while the first runs: the job still runs
    assert not clock.waiting
    time.now += 1.0
    clock.finished(started=True)  # now only the second waits
    assert clock.waiting
    time.now += 3.0
    clock.finished(started=False)  # it ended without a worker (the pool broke)
    time.now += 1.0
    assert not clock.waiting
    assert (clock.elapsed(), clock.waited(), clock.run_time()) == (13.0, 8.0, 5.0)


def test_the_cap_on_a_job_s_time_leaves_room_for_every_other_job_first() -> None:
    config = HookRunnerConfig(concurrency=8, timeout_s=120)
    assert job_time_cap(30, config) == 30 + 8 * 120
    assert job_time_cap(600, config) == 600 + 8 * 600


async def _ended_sessions_with_a_slow_hook(session_factory: SessionFactory) -> list[str]:
    spec = HookSpec(hook="tests.support.reward_functions:slow_marked", name="slow",
                    args={"seconds": RUN_S}, timeout_s=TIMEOUT_S, max_attempts=1)
    ids = [f"sess-queued-{i}" for i in range(JOBS)]
    for session_id in ids:
        record = SessionRecord(id=session_id, key_hash=secrets.token_hex(32),
                               reward_hooks=stored_hooks([spec], default_max_attempts=1))
        await create_session(session_factory, record)
        assert await end_session(session_factory, session_id)
    return ids


async def _settled(session_factory: SessionFactory) -> list[RewardJob]:
    for _ in range(1200):
        async with session_factory() as db:
            jobs = list((await db.execute(select(RewardJob))).scalars())
        if jobs and all(job.state in (JobState.DONE.value, JobState.FAILED.value) for job in jobs):
            return jobs
        await asyncio.sleep(0.05)
    raise AssertionError("the jobs never settled")


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
async def test_jobs_queued_behind_others_for_the_one_worker_all_succeed(
    session_factory: SessionFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "runs.log"
    log.touch()
    monkeypatch.setenv("FLYWHEEL_TEST_HOOK_LOG", str(log))  # before the worker is spawned: it inherits it
    ids = await _ended_sessions_with_a_slow_hook(session_factory)
    # One slot more than jobs: a job whose lease ran out while it waited would be claimed again by this
    # very runner, and run twice. The lease (timeout + margin) is shorter than the last job's wait and run.
    config = HookRunnerConfig(concurrency=JOBS + 1, workers=1, worker_nice=0, poll_interval_s=0.05,
                              timeout_s=TIMEOUT_S, lease_margin_s=0.5, backoff_s=0.0)
    async with ProcessHookPool(1) as pool:
        runner = HookRunner(session_factory, HookRegistry.built_in(), config, pool=pool)
        async with runner.running():
            jobs = await _settled(session_factory)
    assert [(job.state, job.attempts, job.error) for job in jobs] == [(JobState.DONE.value, 1, None)] * JOBS
    assert Counter(log.read_text().split()) == Counter(ids)  # each grader ran exactly once
    async with session_factory() as db:
        rewarded = Counter((await db.execute(select(Reward.session_id))).scalars())
    assert rewarded == Counter(ids)
