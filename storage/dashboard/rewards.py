"""Rewarded sessions for the reward curves: the sessions rewarded last, each with every reward it holds
(on itself and on its completions), read through indexes only: rewards newest first by id, then the
chosen sessions' rewards by `rewards.session_id` and through their completions. Combining them into one
value (the finalizer's rule) is the caller's: rewards/finalize.py sits above storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dashboard.labels import TaskLabel, run_label, task_label
from storage.dashboard.sql import chunks
from storage.engine import SessionFactory
from storage.export_queries import in_run
from storage.models import Completion, Reward, Session, as_utc
from storage.ops_queries import StoredRewardValue

MAX_REWARDED_SESSIONS = 10_000
_SCAN_BATCH = 2_000  # reward rows read per round while looking for the newest rewarded sessions
_MAX_SCAN = 100_000  # reward rows read at most: a curve of sessions each rewarded hundreds of times stops


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardQuery:
    """Which rewarded sessions to read: the `limit` whose newest reward came last, of one run and
    created since a moment when given."""

    run: str | None = None
    since: datetime | None = None  # session created at or after (aware, UTC)
    limit: int = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardedSession:
    """A session with its rewards in arrival order, placed on the curve at `at`: when it ended, or when
    it was created while it is still active."""

    id: str
    status: str
    run: str | None
    task: TaskLabel | None
    at: datetime
    rewards: tuple[StoredRewardValue, ...]


async def rewarded_sessions(session_factory: SessionFactory, query: RewardQuery) -> list[RewardedSession]:
    """The sessions `query` selects, in the order of `at` (then id), oldest first."""
    if not 1 <= query.limit <= MAX_REWARDED_SESSIONS:
        raise ValueError(f"limit must be within 1..{MAX_REWARDED_SESSIONS}")
    async with session_factory() as db:
        ids = await _newest_rewarded(db, query)
        rewards = await rewards_of_sessions(db, ids)
        rows: list[Any] = []
        for chunk in chunks(ids):
            rows += (await db.execute(
                select(Session.id, Session.status, Session.metadata_, Session.task, Session.created_at,
                       Session.ended_at).where(Session.id.in_(list(chunk)))
            )).all()
    found = [
        RewardedSession(
            id=row.id, status=row.status, run=run_label(row.metadata_), task=task_label(row.task),
            at=as_utc(row.ended_at or row.created_at), rewards=tuple(rewards.get(row.id, ())),
        )
        for row in rows
    ]
    return sorted(found, key=lambda s: (s.at, s.id))


async def _newest_rewarded(db: AsyncSession, query: RewardQuery) -> list[str]:
    """Ids of the `limit` sessions whose newest reward is newest, walking rewards back by id."""
    owner = func.coalesce(Reward.session_id, Completion.session_id)
    base: Select[int, str] = (
        select(Reward.id, owner.label("owner"))
        .outerjoin(Completion, Completion.id == Reward.completion_id)
        .order_by(Reward.id.desc())
        .limit(_SCAN_BATCH)
    )
    if query.run is not None or query.since is not None:
        base = base.join(Session, Session.id == owner)
        if query.run is not None:
            base = base.where(in_run(query.run))
        if query.since is not None:
            base = base.where(Session.created_at >= query.since)
    seen: dict[str, None] = {}
    before: int | None = None
    scanned = 0
    while len(seen) < query.limit and scanned < _MAX_SCAN:
        batch = (await db.execute(base if before is None else base.where(Reward.id < before))).all()
        for reward_id, session_id in batch:
            before = reward_id
            seen.setdefault(session_id, None)
            if len(seen) == query.limit:
                break
        scanned += len(batch)
        if len(batch) < _SCAN_BATCH:
            break
    return list(seen)


async def rewards_of_sessions(
    db: AsyncSession, session_ids: Sequence[str]
) -> dict[str, list[StoredRewardValue]]:
    """Per session, its rewards and its completions' in arrival order (reward id)."""
    found: dict[str, list[tuple[int, StoredRewardValue]]] = {}
    for chunk in chunks(session_ids):
        own = select(Reward.session_id.label("owner"), Reward.id, Reward.value, Reward.source,
                     Reward.completion_id).where(Reward.session_id.in_(list(chunk)))
        of_calls = (
            select(Completion.session_id.label("owner"), Reward.id, Reward.value, Reward.source,
                   Reward.completion_id)
            .join(Reward, Reward.completion_id == Completion.id)
            .where(Completion.session_id.in_(list(chunk)))
        )
        for query in (own, of_calls):
            for row in await db.execute(query):
                value = StoredRewardValue(value=float(row.value), source=row.source,
                                          completion_id=row.completion_id)
                found.setdefault(row.owner, []).append((row.id, value))
    return {sid: [value for _, value in sorted(entries, key=lambda e: e[0])]
            for sid, entries in found.items()}
