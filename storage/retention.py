"""Retention of raw request/response JSON (`proxy.privacy.raw_json_retention_s`, docs/privacy.md): the
JSON of a completion is replaced by `PURGED` once its session is done with, that is finalized, ended
longer ago than the retention, and with every trajectory made from it consumed by a train step (or none
made). Token ids, logprobs, rewards and trajectories are kept: training and its records need no text.

Both conditions only ever become true (a finalized session stays finalized, a consumed trajectory stays
consumed), so the rows are chosen in a read and purged by id in short write transactions, a bounded
batch at a time: a SQLite writer waits for the purge no longer than one batch's update."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, exists, func, or_, select, update

from storage.engine import SessionFactory, write_transaction
from storage.models import Completion, Session, SessionStatus, Trajectory

PURGED: dict[str, Any] = {"purged": True}
"""What a purged completion's request_json and response_json hold."""


def is_purged(json_value: dict[str, Any]) -> bool:
    """Whether stored request or response JSON was purged."""
    return json_value.get("purged") is True


def _not_purged() -> ColumnElement[bool]:
    marker = Completion.response_json["purged"].as_boolean()
    return or_(marker.is_(None), marker.is_(False))


def purgeable(cutoff: datetime, limit: int) -> Select[str]:
    """Ids of completions not purged yet whose sessions were finalized, ended before `cutoff`, and have no
    trajectory waiting to be trained on."""
    waiting = exists().where(Trajectory.session_id == Session.id, Trajectory.consumed_step.is_(None))
    return (
        select(Completion.id)
        .join(Session, Session.id == Completion.session_id)
        .where(
            Session.status == SessionStatus.FINALIZED.value,
            Session.ended_at < cutoff,
            ~waiting,
            _not_purged(),
        )
        .limit(limit)
    )


async def count_purgeable(
    session_factory: SessionFactory, older_than_s: float, now: datetime | None = None
) -> int:
    """How many completions a purge with `older_than_s` would purge now (a progress bar's total)."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=older_than_s)
    query = select(func.count()).select_from(purgeable(cutoff, 1).limit(None).subquery())
    async with session_factory() as db:
        return int(await db.scalar(query) or 0)


async def purge_raw_json(
    session_factory: SessionFactory, older_than_s: float, batch: int = 500, now: datetime | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> int:
    """Purge the raw JSON of every completion past retention (`older_than_s` seconds after its session
    ended), `batch` completions per transaction, telling `on_batch` each written batch's size; the number
    purged."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=older_than_s)
    query = purgeable(cutoff, batch)
    total = 0
    while True:
        async with session_factory() as db:
            ids = list((await db.execute(query)).scalars())
        if ids:
            async with write_transaction(session_factory) as db:
                await db.execute(
                    update(Completion)
                    .where(Completion.id.in_(ids))
                    .values(request_json=PURGED, response_json=PURGED)
                )
            if on_batch is not None:
                on_batch(len(ids))
        total += len(ids)
        if len(ids) < batch:
            return total
