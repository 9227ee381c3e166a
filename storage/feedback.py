"""User feedback on completions (`POST /rl/v1/feedback`): stored, and turned into a reward, in one
transaction each, so a feedback is never half-written.

Where it lands depends on its session, read under a lock of the session row (Postgres; SQLite's
BEGIN IMMEDIATE serialises every writer):
- not finalized (active, or ended): a reward on the completion joins the session's trajectories when
  they are built (`applied`);
- finalized: when every trajectory that trains the completion (`trajectories.completion_ids`) is neither
  claimed nor consumed, the reward is written and its change (the new value minus the previous value of
  the same source on that completion) is added to those trajectories' rewards (`applied`); else it is
  stored only (`late`): claimed or consumed already, or trained by no trajectory at all.

A comment alone writes no reward: it is `applied` while the session is not finalized (reward hooks that
run later read it), `late` after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory, affected_rows, write_transaction
from storage.models import (
    Completion,
    Feedback,
    FeedbackState,
    Reward,
    Session,
    SessionStatus,
    Trajectory,
    as_utc,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedbackEntry:
    """One feedback to store: `value` is what it counts as (a thumbs' configured value), None for a
    comment alone."""

    completion_id: str
    session_id: str
    key_hash: str
    value: float | None
    thumbs: str | None
    comment: str | None
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedbackOutcome:
    """What storing one feedback did."""

    feedback_id: int
    state: str
    """"applied" or "late" (FeedbackState)."""
    session_status: str
    """The session's status it was stored against."""
    reward_id: int | None
    """The reward it wrote, if any."""
    trajectories: tuple[int, ...]
    """The finalized trajectories whose reward it changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredFeedback:
    """A feedback row, as the RL API and reward hooks see it."""

    id: int
    completion_id: str
    value: float | None
    thumbs: str | None
    comment: str | None
    state: str
    created_at: datetime


class _ClaimedMeanwhile(Exception):
    """A trajectory was claimed or consumed between its check and its update: roll everything back."""


async def record_feedback(session_factory: SessionFactory, entry: FeedbackEntry) -> FeedbackOutcome:
    """Store one feedback and, where it is in time, its reward (see the module docstring), in one
    transaction. LookupError for an unknown session."""
    try:
        return await _record(session_factory, entry, settle_late=False)
    except _ClaimedMeanwhile:  # everything was rolled back: it came too late
        return await _record(session_factory, entry, settle_late=True)


async def _record(
    session_factory: SessionFactory, entry: FeedbackEntry, *, settle_late: bool
) -> FeedbackOutcome:
    async with write_transaction(session_factory) as db:
        # FOR NO KEY UPDATE: waits for (and holds off) the finalizer's update of the row, not the
        # recorder's inserts of completions that refer to it.
        status = await db.scalar(
            select(Session.status).where(Session.id == entry.session_id).with_for_update(key_share=True)
        )
        if status is None:
            raise LookupError(f"no session {entry.session_id!r}")
        if status != SessionStatus.FINALIZED.value:
            state, reward_id, changed = await _apply_before_finalization(db, entry)
        else:
            state, reward_id, changed = await _apply_to_trajectories(db, entry, settle_late=settle_late)
        row = Feedback(
            completion_id=entry.completion_id,
            session_id=entry.session_id,
            key_hash=entry.key_hash,
            value=entry.value,
            thumbs=entry.thumbs,
            comment=entry.comment,
            state=state,
            reward_id=reward_id,
        )
        db.add(row)
        await db.flush()
        return FeedbackOutcome(
            feedback_id=row.id, state=state, session_status=status, reward_id=reward_id, trajectories=changed
        )


_Applied = tuple[str, int | None, tuple[int, ...]]  # state, the reward written, the trajectories changed


async def _apply_before_finalization(db: AsyncSession, entry: FeedbackEntry) -> _Applied:
    """A reward on the completion (none for a comment alone): the session's trajectories include it."""
    reward_id = None if entry.value is None else await _add_reward(db, entry, entry.value)
    return FeedbackState.APPLIED.value, reward_id, ()


async def _apply_to_trajectories(db: AsyncSession, entry: FeedbackEntry, *, settle_late: bool) -> _Applied:
    """The reward, and its change added to every trajectory that trains the completion, when all of them
    are still unclaimed and unconsumed; else nothing (late)."""
    targets = None if entry.value is None or settle_late else await _trainable_targets(db, entry)
    if entry.value is None or targets is None:
        return FeedbackState.LATE.value, None, ()
    previous = await _previous_value(db, entry)
    reward_id = await _add_reward(db, entry, entry.value)
    await _add_to_trajectories(db, targets, entry.value - (previous or 0.0))
    return FeedbackState.APPLIED.value, reward_id, tuple(targets)


async def _add_reward(db: AsyncSession, entry: FeedbackEntry, value: float) -> int:
    reward = Reward(
        completion_id=entry.completion_id, value=float(value), source=entry.source, details={"feedback": True}
    )
    db.add(reward)
    await db.flush()
    return reward.id


async def _previous_value(db: AsyncSession, entry: FeedbackEntry) -> float | None:
    """The value of the same source on the completion that counts now (the latest), if any."""
    return await db.scalar(
        select(Reward.value)
        .where(Reward.completion_id == entry.completion_id, Reward.source == entry.source)
        .order_by(Reward.id.desc())
        .limit(1)
    )


async def _trainable_targets(db: AsyncSession, entry: FeedbackEntry) -> list[int] | None:
    """The ids of the session's trajectories that train the completion, locked, when there are some and
    none is claimed or consumed; None otherwise. On Postgres a row another transaction holds (a claim or
    a train step in progress) is skipped, not waited for, and counts as claimed."""
    rows = (
        await db.execute(
            select(Trajectory.id, Trajectory.completion_ids)
            .where(Trajectory.session_id == entry.session_id)
            .order_by(Trajectory.id)
        )
    ).all()
    ids = [row.id for row in rows if _trains(row.completion_ids, entry.completion_id)]
    if not ids:
        return None
    free = set(
        (
            await db.execute(
                select(Trajectory.id)
                .where(
                    Trajectory.id.in_(ids),
                    Trajectory.claim_token.is_(None),
                    Trajectory.consumed_step.is_(None),
                )
                .with_for_update(skip_locked=True)
            )
        ).scalars()
    )
    return ids if free.issuperset(ids) else None


def _trains(completion_ids: Any, completion_id: str) -> bool:
    return isinstance(completion_ids, list) and completion_id in completion_ids


async def _add_to_trajectories(db: AsyncSession, ids: Sequence[int], change: float) -> None:
    """Add `change` to the trajectories' rewards, re-checking in the update itself that none was claimed
    or consumed meanwhile (else everything is rolled back and the feedback is looked at again)."""
    result = await db.execute(
        update(Trajectory)
        .where(Trajectory.id.in_(ids), Trajectory.claim_token.is_(None), Trajectory.consumed_step.is_(None))
        .values(reward=Trajectory.reward + change)
    )
    if affected_rows(result) != len(ids):
        raise _ClaimedMeanwhile


async def feedback_of_session(db: AsyncSession, session_id: str) -> list[StoredFeedback]:
    """A session's feedback, oldest first (read inside the caller's transaction)."""
    rows = (
        await db.execute(select(Feedback).where(Feedback.session_id == session_id).order_by(Feedback.id))
    ).scalars()
    return [
        StoredFeedback(
            id=f.id,
            completion_id=f.completion_id,
            value=f.value,
            thumbs=f.thumbs,
            comment=f.comment,
            state=f.state,
            created_at=as_utc(f.created_at),
        )
        for f in rows
    ]


async def latest_owned_completion(session_factory: SessionFactory, owner_key_hash: str) -> str | None:
    """The newest completion (in call order) of the sessions an online key owns; None without any."""
    async with session_factory() as db:
        return await db.scalar(
            select(Completion.id)
            .join(Session, Session.id == Completion.session_id)
            .where(Session.owner_key_hash == owner_key_hash)
            .order_by(Completion.created_at.desc(), Completion.id.desc())
            .limit(1)
        )
