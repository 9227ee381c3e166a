"""The dashboard's sessions table: sessions newest first with filters (run, state, creation time, the
key that made them), a page at a time by keyset (`created_at`, `id`), each measured (calls, generated
tokens, trajectories) with its rewards; and one stored completion, for its tokens.

A filter on rewards needs them combined (rewards/finalize.py, above storage), so the caller passes it as
a predicate over a session's rewards; sessions are then read in batches until the page is full or
`max_scan` sessions were read, and the page's position says where the next one starts either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dashboard.labels import TaskLabel, run_label, task_label
from storage.dashboard.rewards import rewards_of_sessions
from storage.dashboard.sql import chunks
from storage.engine import SessionFactory
from storage.models import ApiKey, Completion, Session, Trajectory, as_utc
from storage.ops_queries import StoredRewardValue, session_conditions
from storage.packing import INT32
from storage.queries import completion_record
from storage.records import CompletionRecord

MAX_PAGE = 200
DEFAULT_MAX_SCAN = 2_000

RewardPredicate = Callable[[Sequence[StoredRewardValue]], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionTableFilter:
    """Which sessions to list; None leaves a criterion out. `since` is inclusive, `until` exclusive."""

    status: str | None = None
    run: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    key_id: int | None = None  # sessions of this API key: its own session, or those an online key made


@dataclass(frozen=True, slots=True, kw_only=True)
class PagePosition:
    """The last session a page read: the next page starts after it."""

    created_at: datetime
    id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRow:
    """One listed session, measured."""

    id: str
    status: str
    group_id: str | None
    run: str | None
    task: TaskLabel | None
    created_at: datetime
    ended_at: datetime | None
    completions: int
    output_tokens: int
    trajectories: int
    rewards: tuple[StoredRewardValue, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionPage:
    """A page of sessions; `next` is None when no session is left after them."""

    rows: tuple[SessionRow, ...]
    next: PagePosition | None
    scanned: int


@dataclass(frozen=True, slots=True)
class _Bare:
    id: str
    status: str
    group_id: str | None
    metadata: dict[str, Any]
    task: Any
    created_at: datetime
    ended_at: datetime | None


async def session_page(
    session_factory: SessionFactory,
    filt: SessionTableFilter,
    after: PagePosition | None,
    limit: int,
    keep: RewardPredicate | None = None,
    max_scan: int = DEFAULT_MAX_SCAN,
) -> SessionPage:
    """Up to `limit` sessions after `after` (newest first) that `filt` selects and whose rewards `keep`
    accepts, reading at most `max_scan` sessions (at least one batch)."""
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be within 1..{MAX_PAGE}")
    batch_size = limit + 1 if keep is None else min(max(4 * limit, 100), 500)
    picked: list[_Bare] = []
    rewards: dict[str, list[StoredRewardValue]] = {}
    position, scanned = after, 0
    async with session_factory() as db:
        while True:
            batch = await _bare_batch(db, filt, position, batch_size)
            batch_rewards = await rewards_of_sessions(db, [s.id for s in batch]) if keep else {}
            for bare in batch:
                if len(picked) == limit:  # one more session follows the full page
                    return await _page(db, picked, rewards if keep else None, position, scanned)
                scanned += 1
                position = PagePosition(created_at=bare.created_at, id=bare.id)
                if keep is None or keep(batch_rewards.get(bare.id, [])):
                    picked.append(bare)
                    rewards[bare.id] = batch_rewards.get(bare.id, [])
            if len(batch) < batch_size:  # none left
                return await _page(db, picked, rewards if keep else None, None, scanned)
            if len(picked) == limit or scanned >= max_scan:
                return await _page(db, picked, rewards if keep else None, position, scanned)


async def _page(
    db: AsyncSession, picked: Sequence[_Bare], rewards: dict[str, list[StoredRewardValue]] | None,
    next_position: PagePosition | None, scanned: int,
) -> SessionPage:
    rows = await _measured(db, picked, rewards)
    return SessionPage(rows=tuple(rows), next=next_position, scanned=scanned)


async def _bare_batch(
    db: AsyncSession, filt: SessionTableFilter, after: PagePosition | None, size: int
) -> list[_Bare]:
    conditions = _conditions(filt)
    if after is not None:
        conditions.append(or_(
            Session.created_at < after.created_at,
            and_(Session.created_at == after.created_at, Session.id < after.id),
        ))
    query = (
        select(Session.id, Session.status, Session.group_id, Session.metadata_, Session.task,
               Session.created_at, Session.ended_at)
        .where(*conditions)
        .order_by(Session.created_at.desc(), Session.id.desc())
        .limit(size)
    )
    return [
        _Bare(id=r.id, status=r.status, group_id=r.group_id, metadata=dict(r.metadata_ or {}), task=r.task,
              created_at=as_utc(r.created_at), ended_at=None if r.ended_at is None else as_utc(r.ended_at))
        for r in await db.execute(query)
    ]


def _conditions(filt: SessionTableFilter) -> list[ColumnElement[bool]]:
    conditions = session_conditions(filt.status, filt.run, filt.since)
    if filt.until is not None:
        conditions.append(Session.created_at < filt.until)
    if filt.key_id is not None:
        key = ApiKey.id == filt.key_id
        conditions.append(or_(
            Session.id == select(ApiKey.session_id).where(key).scalar_subquery(),
            Session.owner_key_hash == select(ApiKey.key_hash).where(key).scalar_subquery(),
        ))
    return conditions


async def _measured(
    db: AsyncSession, picked: Sequence[_Bare], rewards: dict[str, list[StoredRewardValue]] | None
) -> list[SessionRow]:
    """The picked sessions with their sizes and rewards (read now unless given)."""
    ids = [s.id for s in picked]
    if rewards is None:
        rewards = await rewards_of_sessions(db, ids)
    sizes: dict[str, tuple[int, int]] = {}
    samples: dict[str, int] = {}
    for chunk in chunks(ids):
        output_bytes = func.coalesce(func.sum(func.length(Completion.output_ids)), 0)
        for sid, count, size in await db.execute(
            select(Completion.session_id, func.count(), output_bytes)
            .where(Completion.session_id.in_(list(chunk))).group_by(Completion.session_id)
        ):
            sizes[sid] = (int(count), int(size) // INT32.itemsize)
        for sid, count in await db.execute(
            select(Trajectory.session_id, func.count())
            .where(Trajectory.session_id.in_(list(chunk))).group_by(Trajectory.session_id)
        ):
            samples[sid] = int(count)
    return [
        SessionRow(
            id=s.id, status=s.status, group_id=s.group_id, run=run_label(s.metadata), task=task_label(s.task),
            created_at=s.created_at, ended_at=s.ended_at, completions=sizes.get(s.id, (0, 0))[0],
            output_tokens=sizes.get(s.id, (0, 0))[1], trajectories=samples.get(s.id, 0),
            rewards=tuple(rewards.get(s.id, ())),
        )
        for s in picked
    ]


async def load_completion(session_factory: SessionFactory, completion_id: str) -> CompletionRecord | None:
    """One stored completion, or None."""
    async with session_factory() as db:
        row = await db.get(Completion, completion_id)
        return None if row is None else completion_record(row)
