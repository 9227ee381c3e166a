"""Read one session as the finalizer and the RL API see it: its row, its completions in call order, its
rewards and its users' feedback in arrival order, read in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from rewards.finalize import RewardEntry
from storage.engine import SessionFactory
from storage.feedback import StoredFeedback, feedback_of_session
from storage.models import Completion, Reward, Session, as_utc
from storage.queries import completion_record
from storage.records import CompletionRecord
from storage.reward_jobs import has_hooks, hooks_pending


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredReward:
    """A reward row as the RL API reports it."""

    id: int
    value: float
    source: str
    completion_id: str | None
    details: dict[str, Any]
    created_at: datetime

    def entry(self) -> RewardEntry:
        return RewardEntry(value=self.value, source=self.source, completion_id=self.completion_id)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SessionSnapshot:
    """A session with everything recorded for it."""

    id: str
    status: str
    group_id: str | None
    task: Any
    metadata: dict[str, Any]
    created_at: datetime
    ended_at: datetime | None
    completions: tuple[CompletionRecord, ...]  # call order: created_at, then id
    rewards: tuple[StoredReward, ...]  # arrival order
    has_hooks: bool = False
    """Reward hooks label it (its own or its group's); read only when asked for (`hook_state`)."""
    hooks_pending: bool = False
    """One of those hooks has not settled yet (its group's have not even been queued while the group has
    sessions still active)."""
    feedback: tuple[StoredFeedback, ...] = ()
    """Its users' feedback (`POST /rl/v1/feedback`), in arrival order."""

    def reward_entries(self) -> list[RewardEntry]:
        return [reward.entry() for reward in self.rewards]


async def load_session_snapshot(
    session_factory: SessionFactory, session_id: str, *, hook_state: bool = False
) -> SessionSnapshot | None:
    """The session with its completions and rewards, or None if there is no such session; with
    `hook_state` (what the finalizer decides by), whether it has reward hooks and whether they are pending
    (else both False)."""
    async with session_factory() as db, db.begin():
        session = await db.get(Session, session_id)
        if session is None:
            return None
        completions = await _completions(db, session_id)
        rewards = await _rewards(db, session_id)
        feedback = await feedback_of_session(db, session_id)
        hooks = (False, False)
        if hook_state:
            hooks = (
                await db.execute(select(has_hooks(), hooks_pending()).where(Session.id == session_id))
            ).one()
    return SessionSnapshot(
        id=session.id,
        status=session.status,
        group_id=session.group_id,
        task=session.task,
        metadata=dict(session.metadata_),
        created_at=as_utc(session.created_at),
        ended_at=None if session.ended_at is None else as_utc(session.ended_at),
        completions=tuple(completions),
        rewards=tuple(rewards),
        has_hooks=bool(hooks[0]),
        hooks_pending=bool(hooks[1]),
        feedback=tuple(feedback),
    )


async def _completions(db: AsyncSession, session_id: str) -> list[CompletionRecord]:
    rows = (
        await db.execute(
            select(Completion)
            .where(Completion.session_id == session_id)
            .order_by(Completion.created_at, Completion.id)
        )
    ).scalars()
    return [completion_record(c) for c in rows]


async def _rewards(db: AsyncSession, session_id: str) -> Sequence[StoredReward]:
    of_session_completions = select(Completion.id).where(Completion.session_id == session_id)
    rows = (
        await db.execute(
            select(Reward)
            .where(or_(Reward.session_id == session_id, Reward.completion_id.in_(of_session_completions)))
            .order_by(Reward.id)
        )
    ).scalars()
    return [
        StoredReward(
            id=r.id,
            value=r.value,
            source=r.source,
            completion_id=r.completion_id,
            details=dict(r.details),
            created_at=as_utc(r.created_at),
        )
        for r in rows
    ]
