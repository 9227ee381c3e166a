"""What `flywheel status` and `flywheel sessions` read: counts of what waits where (sessions by status,
trajectories by claim, reward hook jobs by state), the trainer's progress, and sessions listed with their
sizes. Read-only, each a few aggregate queries; per-token arrays are measured in SQL (`length` of the
packed buffer), never loaded, except for one session's trajectories.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory
from storage.export_queries import in_run
from storage.models import (
    Completion,
    Group,
    PolicyVersion,
    Reward,
    RewardJob,
    Session,
    TrainStep,
    Trajectory,
    as_utc,
)
from storage.packing import INT32


@dataclass(frozen=True, slots=True, kw_only=True)
class Backlog:
    """What the database holds and what waits on whom."""

    sessions: dict[str, int]  # by status: active (open), ended (awaiting reward or hooks), finalized
    groups: int
    completions: int
    last_completion_at: datetime | None
    trajectories: int
    unconsumed: int  # rewarded samples waiting for a step: neither consumed nor dropped (claimed included)
    claimed: int  # … of which a trainer holds a claim on now
    dropped: int  # samples a claim dropped as older than η: never trained
    reward_jobs: dict[str, int]  # by state: queued, running, done, failed
    policy_versions: dict[str, int]  # by status: candidate, promoted, rejected


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainProgress:
    """The trainer's recorded steps."""

    steps: int
    last_step: int | None = None
    last_step_version: int | None = None
    last_step_at: datetime | None = None
    last_metrics: dict[str, Any] = field(default_factory=dict)


async def _counts_by(session_factory: SessionFactory, column: Any) -> dict[str, int]:
    async with session_factory() as db:
        rows = (await db.execute(select(column, func.count()).group_by(column))).all()
    return {str(key): int(count) for key, count in rows}


async def backlog(session_factory: SessionFactory) -> Backlog:
    """Sessions, completions, trajectories, reward jobs and policy versions, counted."""
    unconsumed = Trajectory.consumed_step.is_(None)
    waits = and_(unconsumed, Trajectory.dropped_at.is_(None))
    async with session_factory() as db:
        completions, last_completion = (
            await db.execute(select(func.count(), func.max(Completion.created_at)).select_from(Completion))
        ).one()
        trajectories, waiting, claimed, dropped = (
            await db.execute(
                select(
                    func.count(),
                    func.count().filter(waits),
                    func.count().filter(waits, Trajectory.claim_token.is_not(None)),
                    func.count().filter(Trajectory.dropped_at.is_not(None)),
                ).select_from(Trajectory)
            )
        ).one()
        groups = await db.scalar(select(func.count()).select_from(Group))
    return Backlog(
        sessions=await _counts_by(session_factory, Session.status),
        groups=int(groups or 0),
        completions=int(completions),
        last_completion_at=None if last_completion is None else as_utc(last_completion),
        trajectories=int(trajectories),
        unconsumed=int(waiting),
        claimed=int(claimed),
        dropped=int(dropped),
        reward_jobs=await _counts_by(session_factory, RewardJob.state),
        policy_versions=await _counts_by(session_factory, PolicyVersion.status),
    )


async def train_progress(session_factory: SessionFactory) -> TrainProgress:
    """How many steps were recorded, and the last one."""
    async with session_factory() as db:
        steps = int(await db.scalar(select(func.count()).select_from(TrainStep)) or 0)
        last = await db.scalar(select(TrainStep).order_by(TrainStep.step.desc()).limit(1))
    if last is None:
        return TrainProgress(steps=steps)
    return TrainProgress(steps=steps, last_step=last.step, last_step_version=last.policy_version,
                         last_step_at=as_utc(last.created_at), last_metrics=dict(last.metrics or {}))


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFilter:
    """Which sessions to list, newest first; None leaves a criterion out."""

    status: str | None = None
    run: str | None = None  # the session metadata's `run` label
    since: datetime | None = None  # created at or after (aware, UTC)
    limit: int = 50


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRewardValue:
    """One reward row: on the session (`completion_id` None) or one of its completions."""

    value: float
    source: str
    completion_id: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSummary:
    """One session, measured: its calls, the tokens they generated, its rewards (arrival order) and its
    trajectories."""

    id: str
    status: str
    group_id: str | None
    metadata: dict[str, Any]
    created_at: datetime
    ended_at: datetime | None
    completions: int
    output_tokens: int
    trajectories: int
    rewards: tuple[StoredRewardValue, ...]


def session_conditions(
    status: str | None, run: str | None, since: datetime | None
) -> list[ColumnElement[bool]]:
    """The WHERE conditions of a sessions listing: its status, its metadata's `run` label, created at or
    after `since`; None leaves a criterion out."""
    conditions: list[ColumnElement[bool]] = []
    if status is not None:
        conditions.append(Session.status == status)
    if run is not None:
        conditions.append(in_run(run))
    if since is not None:
        conditions.append(Session.created_at >= since)
    return conditions


async def list_sessions(session_factory: SessionFactory, filt: SessionFilter) -> list[SessionSummary]:
    """At most `filt.limit` sessions, newest first, each with its counts and rewards."""
    query = (
        select(Session)
        .where(*session_conditions(filt.status, filt.run, filt.since))
        .order_by(Session.created_at.desc(), Session.id.desc())
        .limit(filt.limit)
    )
    async with session_factory() as db:
        sessions = list((await db.execute(query)).scalars())
        ids = [s.id for s in sessions]
        calls = await _completion_sizes(db, ids)
        samples = await _trajectory_counts(db, ids)
        rewards = await _rewards_of(db, ids)
    summaries = []
    for s in sessions:
        completions, output_tokens = calls.get(s.id, (0, 0))
        summaries.append(SessionSummary(
            id=s.id, status=s.status, group_id=s.group_id, metadata=dict(s.metadata_ or {}),
            created_at=as_utc(s.created_at), ended_at=None if s.ended_at is None else as_utc(s.ended_at),
            completions=completions, output_tokens=output_tokens, trajectories=samples.get(s.id, 0),
            rewards=tuple(rewards.get(s.id, ())),
        ))
    return summaries


async def _trajectory_counts(db: AsyncSession, session_ids: Sequence[str]) -> dict[str, int]:
    if not session_ids:
        return {}
    rows = await db.execute(
        select(Trajectory.session_id, func.count())
        .where(Trajectory.session_id.in_(list(session_ids)))
        .group_by(Trajectory.session_id)
    )
    return {sid: int(count) for sid, count in rows}


async def _completion_sizes(db: AsyncSession, session_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per session: completions, and output tokens (the packed `<i4` buffers' bytes over 4)."""
    if not session_ids:
        return {}
    output_bytes = func.coalesce(func.sum(func.length(Completion.output_ids)), 0)
    rows = await db.execute(
        select(Completion.session_id, func.count(), output_bytes)
        .where(Completion.session_id.in_(list(session_ids)))
        .group_by(Completion.session_id)
    )
    return {sid: (int(count), int(size) // INT32.itemsize) for sid, count, size in rows}


async def _rewards_of(db: AsyncSession, session_ids: Sequence[str]) -> dict[str, list[StoredRewardValue]]:
    """Per session, its rewards and its completions' in arrival order."""
    if not session_ids:
        return {}
    owner = func.coalesce(Reward.session_id, Completion.session_id)
    rows = await db.execute(
        select(owner.label("owner"), Reward.value, Reward.source, Reward.completion_id)
        .outerjoin(Completion, Completion.id == Reward.completion_id)
        .where(owner.in_(list(session_ids)))
        .order_by(Reward.id)
    )
    found: dict[str, list[StoredRewardValue]] = {}
    for row in rows:
        found.setdefault(row.owner, []).append(
            StoredRewardValue(value=float(row.value), source=row.source, completion_id=row.completion_id)
        )
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectorySummary:
    """One of a session's trajectories, measured."""

    id: int
    tokens: int
    trained_tokens: int
    reward: float
    min_version: int
    completion_ids: tuple[str, ...]
    claimed: bool
    consumed_step: int | None


async def session_trajectories(session_factory: SessionFactory, session_id: str) -> list[TrajectorySummary]:
    """A session's trajectories in id order."""
    query = select(Trajectory).where(Trajectory.session_id == session_id).order_by(Trajectory.id)
    async with session_factory() as db:
        rows = list((await db.execute(query)).scalars())
    return [
        TrajectorySummary(
            id=t.id, tokens=len(t.token_ids), trained_tokens=int(t.loss_mask.sum()), reward=float(t.reward),
            min_version=t.min_version, completion_ids=tuple(t.completion_ids or ()),
            claimed=t.claim_token is not None, consumed_step=t.consumed_step,
        )
        for t in rows
    ]
