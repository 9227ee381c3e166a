"""The durable queue of reward hook jobs (reward_jobs): queued when a session ends, claimed by hook runners
with a lease, settled once.

- Queued: `end_session` calls `queue_jobs_on_end` in its own transaction, one job per hook stored on the
  session (`sessions.reward_hooks`), plus one per group hook (`groups.reward_hooks`) when the session was its
  group's last to end.
- Claimed: due jobs (queued and past `run_after`, or running with an expired lease: their runner died) are
  leased to one runner with a fresh token; Postgres skips rows another claimer holds (`FOR UPDATE SKIP
  LOCKED`), SQLite claims under BEGIN IMMEDIATE. A claim counts an attempt.
- Settled: `complete_job` writes the hook's rewards and marks the job done in one transaction, only while
  the runner still holds the lease, so a job that runs twice (a runner presumed dead that was only slow)
  writes its rewards once. `fail_job` queues it again after a delay, or marks it failed past its attempts.

A session is not finalized while `hooks_pending` holds for it (rewards/finalizer.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory, affected_rows, write_transaction
from storage.models import Group, JobState, Reward, RewardJob, Session, SessionStatus

OPEN_STATES = (JobState.QUEUED.value, JobState.RUNNING.value)
_ERROR_MAX_CHARS = 4000


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredHook:
    """One entry of `sessions.reward_hooks` / `groups.reward_hooks`: the source its rewards carry, its
    attempt limit, and the spec the runner resolves."""

    source: str
    max_attempts: int
    spec: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "max_attempts": self.max_attempts, "spec": self.spec}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedJob:
    """A job leased to one runner: only the holder of `lease_token` may settle it."""

    id: int
    session_id: str | None
    group_id: str | None
    source: str
    spec: dict[str, Any]
    attempts: int
    max_attempts: int
    lease_token: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardRow:
    """A reward a job writes: on the session, or on one completion (`completion_id`)."""

    value: float
    session_id: str | None = None
    completion_id: str | None = None
    details: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """A job as the RL API shows it."""

    id: int
    level: str  # "session" or "group"
    source: str
    state: str
    attempts: int
    max_attempts: int
    error: str | None
    result: dict[str, Any] | None
    created_at: datetime
    finished_at: datetime | None


def _rows(hooks: Any, now: datetime, **subject: str) -> list[dict[str, Any]]:
    return [
        {**subject, "source": hook["source"], "spec": hook["spec"], "state": JobState.QUEUED.value,
         "attempts": 0, "max_attempts": int(hook["max_attempts"]), "run_after": now}
        for hook in hooks or ()
    ]


async def queue_jobs_on_end(db: AsyncSession, session_id: str, hooks: Any, group_id: str | None) -> None:
    """Inside the transaction that ended `session_id`: queue the jobs of its `hooks` (its `reward_hooks`),
    and its group's when every session of the group has now ended (the caller holds the group's row
    lock)."""
    now = datetime.now(UTC)
    rows = _rows(hooks, now, session_id=session_id)
    if group_id is not None:
        group_hooks, size = (
            await db.execute(select(Group.reward_hooks, Group.size).where(Group.id == group_id))
        ).one()
        if group_hooks:
            ended = await db.scalar(
                select(func.count()).select_from(Session)
                .where(Session.group_id == group_id, Session.status != SessionStatus.ACTIVE.value)
            )
            queued = await db.scalar(select(exists().where(RewardJob.group_id == group_id)))
            if ended == size and not queued:
                rows += _rows(group_hooks, now, group_id=group_id)
    if rows:
        await db.execute(insert(RewardJob), rows)


def hooks_pending() -> ColumnElement[bool]:
    """For a `Session` row in the query: one of its hooks, or of its group's, has not settled yet (a group
    whose sessions have not all ended has not even queued its hooks)."""
    own = exists().where(RewardJob.session_id == Session.id, RewardJob.state.in_(OPEN_STATES))
    group = exists().where(RewardJob.group_id == Session.group_id, RewardJob.state.in_(OPEN_STATES))
    group_hooks = exists().where(Group.id == Session.group_id, Group.reward_hooks.is_not(None))
    not_queued = ~exists().where(RewardJob.group_id == Session.group_id)
    return or_(own, group, and_(Session.group_id.is_not(None), group_hooks, not_queued))


def has_hooks() -> ColumnElement[bool]:
    """For a `Session` row: it, or its group, has reward hooks."""
    group_hooks = exists().where(Group.id == Session.group_id, Group.reward_hooks.is_not(None))
    return or_(Session.reward_hooks.is_not(None), group_hooks)


async def claim_jobs(session_factory: SessionFactory, limit: int, lease_s: float) -> list[ClaimedJob]:
    """Lease up to `limit` due jobs, oldest due first. A running job whose lease expired on its last
    attempt is marked failed instead (its runner died running it)."""
    now = datetime.now(UTC)
    token = str(uuid.uuid4())
    expired = and_(RewardJob.state == JobState.RUNNING.value, RewardJob.lease_until < now)
    due = or_(and_(RewardJob.state == JobState.QUEUED.value, RewardJob.run_after <= now), expired)
    async with session_factory() as db:  # a plain read first: an idle poll takes no write lock
        if await db.scalar(select(RewardJob.id).where(due).limit(1)) is None:
            return []
    async with write_transaction(session_factory) as db:
        await db.execute(
            update(RewardJob)
            .where(expired, RewardJob.attempts >= RewardJob.max_attempts)
            .values(state=JobState.FAILED.value, lease_token=None, lease_until=None, finished_at=now,
                    error="its runner stopped (lease expired) during its last attempt")
        )
        ids = list(
            (
                await db.execute(
                    select(RewardJob.id).where(due).order_by(RewardJob.run_after, RewardJob.id)
                    .limit(limit).with_for_update(skip_locked=True)
                )
            ).scalars()
        )
        if not ids:
            return []
        await db.execute(
            update(RewardJob)
            .where(RewardJob.id.in_(ids))
            .values(state=JobState.RUNNING.value, lease_token=token,
                    lease_until=now + timedelta(seconds=lease_s), attempts=RewardJob.attempts + 1)
        )
        query = select(RewardJob).where(RewardJob.id.in_(ids)).order_by(RewardJob.id)
        jobs = (await db.execute(query)).scalars()
        return [
            ClaimedJob(id=job.id, session_id=job.session_id, group_id=job.group_id, source=job.source,
                       spec=dict(job.spec), attempts=job.attempts, max_attempts=job.max_attempts,
                       lease_token=token)
            for job in jobs
        ]


def _held(job: ClaimedJob) -> ColumnElement[bool]:
    return and_(RewardJob.id == job.id, RewardJob.lease_token == job.lease_token,
                RewardJob.state == JobState.RUNNING.value)


async def complete_job(
    session_factory: SessionFactory, job: ClaimedJob, rewards: Sequence[RewardRow], result: dict[str, Any]
) -> bool:
    """Write `rewards` and mark the job done, atomically; False (nothing written) when the lease was lost."""
    async with write_transaction(session_factory) as db:
        settled = await db.execute(
            update(RewardJob).where(_held(job))
            .values(state=JobState.DONE.value, lease_token=None, lease_until=None, error=None, result=result,
                    finished_at=datetime.now(UTC))
        )
        if affected_rows(settled) != 1:
            return False
        if rewards:
            await db.execute(insert(Reward), [
                {"session_id": row.session_id, "completion_id": row.completion_id, "value": float(row.value),
                 "source": job.source, "details": dict(row.details or {})}
                for row in rewards
            ])
    return True


async def fail_job(
    session_factory: SessionFactory, job: ClaimedJob, error: str, retry_in_s: float
) -> str | None:
    """Record a failed attempt: queued again after `retry_in_s`, or failed once its attempts are used up.
    Returns the new state, None when the lease was lost (another runner has the job)."""
    now = datetime.now(UTC)
    final = job.attempts >= job.max_attempts
    state = JobState.FAILED.value if final else JobState.QUEUED.value
    async with write_transaction(session_factory) as db:
        settled = await db.execute(
            update(RewardJob).where(_held(job))
            .values(state=state, error=error[:_ERROR_MAX_CHARS], lease_token=None, lease_until=None,
                    run_after=now + timedelta(seconds=retry_in_s), finished_at=now if final else None)
        )
    return state if affected_rows(settled) == 1 else None


async def jobs_of_session(session_factory: SessionFactory, session_id: str) -> list[JobView]:
    """The session's jobs and its group's, oldest first."""
    async with session_factory() as db:
        group_id = await db.scalar(select(Session.group_id).where(Session.id == session_id))
        subject = RewardJob.session_id == session_id
        if group_id is not None:
            subject = or_(subject, RewardJob.group_id == group_id)
        jobs = (await db.execute(select(RewardJob).where(subject).order_by(RewardJob.id))).scalars()
        return [
            JobView(id=job.id, level="session" if job.session_id is not None else "group", source=job.source,
                    state=job.state, attempts=job.attempts, max_attempts=job.max_attempts, error=job.error,
                    result=job.result, created_at=job.created_at, finished_at=job.finished_at)
            for job in jobs
        ]


async def group_members(session_factory: SessionFactory, group_id: str) -> tuple[Any, list[str]]:
    """A group's task and its sessions' ids, in creation order; LookupError for an unknown group."""
    async with session_factory() as db:
        group = await db.get(Group, group_id)
        if group is None:
            raise LookupError(f"no group {group_id!r}")
        ids = (await db.execute(
            select(Session.id).where(Session.group_id == group_id).order_by(Session.created_at, Session.id)
        )).scalars()
        return group.task, list(ids)


async def extend_lease(session_factory: SessionFactory, job: ClaimedJob, lease_s: float) -> bool:
    """Hold the job `lease_s` from now (a hook whose own timeout is longer than the claim's lease); False
    when the lease was lost."""
    async with write_transaction(session_factory) as db:
        extended = await db.execute(
            update(RewardJob).where(_held(job))
            .values(lease_until=datetime.now(UTC) + timedelta(seconds=lease_s))
        )
    return affected_rows(extended) == 1


async def release_job(session_factory: SessionFactory, job: ClaimedJob) -> None:
    """A runner stopping hands a running job back: queued again at once, its attempt not counted."""
    async with write_transaction(session_factory) as db:
        await db.execute(
            update(RewardJob).where(_held(job))
            .values(state=JobState.QUEUED.value, lease_token=None, lease_until=None,
                    attempts=RewardJob.attempts - 1, run_after=datetime.now(UTC))
        )
