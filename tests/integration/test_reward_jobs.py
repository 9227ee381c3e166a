"""The reward job queue on SQLite and Postgres: jobs queued with a session's end (its group's with the last
member's, once, however the ends race), leased to one claimer at a time, settled once by the lease holder
only, retried with backoff and failed past their attempts, and taken over when a runner's lease expires."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from rewards.hooks.spec import HookSpec, stored_hooks
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import Reward, RewardJob
from storage.queries import create_group, create_session, end_session
from storage.records import GroupRecord, SessionRecord
from storage.reward_jobs import (
    ClaimedJob,
    RewardRow,
    claim_jobs,
    complete_job,
    fail_job,
    jobs_of_session,
    release_job,
)

HOOKS = stored_hooks([HookSpec(hook="math"), HookSpec(hook="exact", weight=0.5)], default_max_attempts=2)
GROUP_HOOKS = stored_hooks([HookSpec(hook="group_ranking", args={})], default_max_attempts=2)


@pytest.fixture
async def db(db_url: str) -> AsyncIterator[SessionFactory]:
    engine = create_engine(StorageConfig(url=db_url))
    yield create_sessionmaker(engine)
    await engine.dispose()


async def new_session(db: SessionFactory, hooks: Any = HOOKS, group_id: str | None = None) -> str:
    session_id = f"sess-{secrets.token_hex(6)}"
    await create_session(db, SessionRecord(id=session_id, key_hash=secrets.token_hex(32), group_id=group_id,
                                           reward_hooks=hooks))
    return session_id


async def jobs(db: SessionFactory) -> list[RewardJob]:
    async with db() as session:
        return list((await session.execute(select(RewardJob).order_by(RewardJob.id))).scalars())


async def reward_count(db: SessionFactory) -> int:
    async with db() as session:
        return int(await session.scalar(select(func.count()).select_from(Reward)) or 0)


async def test_ending_a_session_queues_one_job_per_hook_once(db: SessionFactory) -> None:
    with_hooks, without = await new_session(db), await new_session(db, hooks=None)
    assert await jobs(db) == []  # nothing before the end
    assert await end_session(db, with_hooks) and await end_session(db, without)
    assert not await end_session(db, with_hooks)  # ending again queues nothing more
    queued = await jobs(db)
    assert [(j.session_id, j.source, j.state, j.max_attempts) for j in queued] == [
        (with_hooks, "hook:math", "queued", 2), (with_hooks, "hook:exact", "queued", 2)]
    assert queued[1].spec == {"hook": "exact", "weight": 0.5}


async def test_a_claim_leases_each_job_to_one_claimer(db: SessionFactory) -> None:
    for _ in range(6):
        await end_session(db, await new_session(db))
    claims = await asyncio.gather(*(claim_jobs(db, 3, lease_s=60) for _ in range(5)))
    claimed = [job.id for claim in claims for job in claim]
    assert sorted(claimed) == [job.id for job in await jobs(db)]  # all 12, none twice
    assert await claim_jobs(db, 10, lease_s=60) == []
    assert all(job.state == "running" and job.attempts == 1 for job in await jobs(db))


async def test_only_the_lease_holder_settles_a_job_and_only_once(db: SessionFactory) -> None:
    session_id = await new_session(db)
    await end_session(db, session_id)
    job, _ = await claim_jobs(db, 2, lease_s=60)
    row = RewardRow(value=0.5, session_id=session_id, details={"raw": 1.0})
    stolen = ClaimedJob(**{**_fields(job), "lease_token": "not-the-lease"})
    assert not await complete_job(db, stolen, [row], {"opinion": True})
    assert await reward_count(db) == 0
    assert await complete_job(db, job, [row], {"opinion": True})
    assert not await complete_job(db, job, [row], {"opinion": True})  # a second run writes nothing
    assert await reward_count(db) == 1
    assert (await jobs(db))[0].state == "done"


async def test_an_expired_lease_is_taken_over_and_the_old_holder_can_no_longer_settle(
    db: SessionFactory,
) -> None:
    session_id = await new_session(db, hooks=HOOKS[:1])
    await end_session(db, session_id)
    [old] = await claim_jobs(db, 1, lease_s=60)
    await _expire_leases(db)
    [new] = await claim_jobs(db, 1, lease_s=60)
    assert new.id == old.id and new.lease_token != old.lease_token and new.attempts == 2
    assert not await complete_job(db, old, [RewardRow(value=1.0, session_id=session_id)], {})
    assert await complete_job(db, new, [RewardRow(value=1.0, session_id=session_id)], {})
    assert await reward_count(db) == 1


async def test_failures_back_off_then_fail_and_a_lost_last_attempt_fails(db: SessionFactory) -> None:
    first, second = await new_session(db, hooks=HOOKS[:1]), await new_session(db, hooks=HOOKS[:1])
    await end_session(db, first)
    [job] = await claim_jobs(db, 1, lease_s=60)
    assert await fail_job(db, job, "boom", retry_in_s=3600) == "queued"
    assert await claim_jobs(db, 1, lease_s=60) == []  # not due before its backoff
    await _due_now(db)
    [job] = await claim_jobs(db, 1, lease_s=60)
    assert await fail_job(db, job, "boom again", retry_in_s=0) == "failed"  # 2 of 2 attempts
    await end_session(db, second)
    [job] = await claim_jobs(db, 1, lease_s=60)
    assert await claim_jobs(db, 1, lease_s=60) == []  # leased: nobody else may run it
    await _expire_leases(db)
    [job] = await claim_jobs(db, 1, lease_s=60)  # its runner died: run again (attempt 2 of 2)
    await _expire_leases(db)
    assert await claim_jobs(db, 1, lease_s=60) == []  # died again, on its last attempt: failed
    states = [(j.session_id, j.state, j.attempts, j.error) for j in await jobs(db)]
    assert states[0] == (first, "failed", 2, "boom again")
    assert states[1][1:3] == ("failed", 2) and "lease expired" in (states[1][3] or "")


async def test_a_stopping_runner_hands_its_job_back_without_using_an_attempt(db: SessionFactory) -> None:
    session_id = await new_session(db, hooks=HOOKS[:1])
    await end_session(db, session_id)
    [job] = await claim_jobs(db, 1, lease_s=60)
    await release_job(db, job)
    [again] = await claim_jobs(db, 1, lease_s=60)
    assert again.id == job.id and again.attempts == 1


async def test_group_hooks_are_queued_once_when_the_last_member_ends(db: SessionFactory) -> None:
    group_id = f"grp-{secrets.token_hex(4)}"
    await create_group(db, GroupRecord(id=group_id, size=4, reward_hooks=GROUP_HOOKS))
    members = [await new_session(db, hooks=None, group_id=group_id) for _ in range(4)]
    await end_session(db, members[0])
    assert await jobs(db) == []
    await asyncio.gather(*(end_session(db, member) for member in members[1:]))  # racing ends
    [job] = await jobs(db)
    assert (job.group_id, job.session_id, job.source) == (group_id, None, "hook:group_ranking")
    views = await jobs_of_session(db, members[2])
    assert [(v.level, v.source, v.state) for v in views] == [("group", "hook:group_ranking", "queued")]


def _fields(job: ClaimedJob) -> dict[str, Any]:
    return {name: getattr(job, name) for name in ClaimedJob.__dataclass_fields__}


async def _expire_leases(db: SessionFactory) -> None:
    async with db() as session, session.begin():
        await session.execute(update(RewardJob).values(lease_until=datetime.now(UTC) - timedelta(seconds=1)))


async def _due_now(db: SessionFactory) -> None:
    async with db() as session, session.begin():
        await session.execute(update(RewardJob).values(run_after=datetime.now(UTC) - timedelta(seconds=1)))
