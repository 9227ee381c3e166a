"""Rewards written by the RL API and the tests (`add_reward`), held to their session's state across every
process on the database: a reward is refused once its session is finalized, and one written while a
finalization builds makes it build again (storage.queries.insert_trajectories counts `rewards_of`).
Hook jobs write theirs in storage/reward_jobs.py, feedback in storage/feedback.py."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory, write_transaction
from storage.models import Completion, Reward, Session, SessionStatus


class SessionFinalizedError(ValueError):
    """The session is finalized: a reward (or anything else that must reach its trajectories) is too late."""


async def add_reward(
    session_factory: SessionFactory,
    value: float,
    *,
    session_id: str | None = None,
    completion_id: str | None = None,
    source: str = "rest",
    details: dict[str, Any] | None = None,
) -> int:
    """Attach a reward to exactly one of a session or a completion; returns its id.
    NaN and ±inf are a ValueError and write nothing; a reward on a finalized session (or on a completion
    of one) is a SessionFinalizedError and writes nothing, whichever process finalized it: its
    trajectories are written, so it could no longer count. Its session's row is read under a lock (FOR
    NO KEY UPDATE on Postgres; SQLite serialises writers), so a finalization either sees the reward (and
    `insert_trajectories` builds again with it) or finishes first and the reward is refused."""
    if (session_id is None) == (completion_id is None):
        raise ValueError("a reward needs exactly one of session_id and completion_id")
    if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"reward must be a finite number, got {value!r}")
    async with write_transaction(session_factory) as db:
        await _lock_open_session(db, session_id, completion_id)
        reward = Reward(
            session_id=session_id,
            completion_id=completion_id,
            value=float(value),
            source=source,
            details=dict(details or {}),
        )
        db.add(reward)
        await db.flush()
        return reward.id


async def _lock_open_session(db: AsyncSession, session_id: str | None, completion_id: str | None) -> None:
    """Lock the row of the reward's session (`session_id`, or the session of `completion_id`) against its
    finalization until the transaction ends; SessionFinalizedError if it is finalized already. An
    unknown target is left to the foreign keys."""
    if session_id is None:
        session_id = await db.scalar(select(Completion.session_id).where(Completion.id == completion_id))
        if session_id is None:
            return
    status = await db.scalar(
        select(Session.status).where(Session.id == session_id).with_for_update(key_share=True)
    )
    if status == SessionStatus.FINALIZED.value:
        raise SessionFinalizedError(f"session {session_id!r} is finalized: its trajectories are written")


def rewards_of(session_id: str) -> ColumnElement[bool]:
    """The rewards that count for a session: on it, or on one of its completions."""
    of_completions = select(Completion.id).where(Completion.session_id == session_id)
    return or_(Reward.session_id == session_id, Reward.completion_id.in_(of_completions))
