"""Read trajectories out for `flywheel export`: a filter, and the rows it selects streamed in id order a
bounded batch at a time (keyset pagination: each batch is one short query, never a whole-table load).

A run is the `run` label sessions carry in their metadata (`POST /rl/v1/sessions {"metadata": {"run":
…}}`); one database may hold several. Versions are of the generated tokens only (`versions >= 0`): a row
is in `[min_version, max_version]` when every one of its generated tokens is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import ColumnElement, Select, and_, func, select

from storage.engine import SessionFactory
from storage.models import Session, Trajectory, as_utc
from storage.packing import BoolArray, FloatArray, IntArray

RUN_METADATA_KEY = "run"
"""The session metadata key that names a session's run."""


def in_run(run: str) -> ColumnElement[bool]:
    """The condition that a session's metadata names `run` as its run."""
    return Session.metadata_[RUN_METADATA_KEY].as_string() == run


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryFilter:
    """Which trajectories to read; None (or False) leaves a criterion out. Bounds are inclusive, except
    `until`, which is exclusive."""

    run: str | None = None
    min_version: int | None = None
    max_version: int | None = None
    min_reward: float | None = None
    since: datetime | None = None  # trajectory created at or after (aware, UTC)
    until: datetime | None = None  # … and before
    consumed: bool | None = None  # True: trained on already; False: not yet; None: either


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ExportRow:
    """One trajectory with its session's task and metadata."""

    trajectory_id: int
    session_id: str
    group_id: str | None
    token_ids: IntArray
    loss_mask: BoolArray
    logprobs: FloatArray
    versions: IntArray
    reward: float
    temperature: float
    min_version: int
    max_version: int
    consumed_step: int | None
    completion_ids: tuple[str, ...]
    task: Any
    metadata: dict[str, Any]
    created_at: datetime


def _conditions(filt: TrajectoryFilter) -> list[ColumnElement[bool]]:
    """What SQL can decide; the upper version bound also needs each row's newest token (`keep`)."""
    conditions: list[ColumnElement[bool]] = []
    if filt.run is not None:
        conditions.append(in_run(filt.run))
    if filt.min_version is not None:
        conditions.append(Trajectory.min_version >= filt.min_version)
    if filt.max_version is not None:
        conditions.append(Trajectory.min_version <= filt.max_version)
    if filt.min_reward is not None:
        conditions.append(Trajectory.reward >= filt.min_reward)
    if filt.since is not None:
        conditions.append(Trajectory.created_at >= filt.since)
    if filt.until is not None:
        conditions.append(Trajectory.created_at < filt.until)
    if filt.consumed is not None:
        consumed = Trajectory.consumed_step.is_not(None)
        conditions.append(consumed if filt.consumed else ~consumed)
    return conditions


def keep(row: ExportRow, filt: TrajectoryFilter) -> bool:
    """The part of the filter SQL cannot check: every generated token at most `max_version`."""
    return filt.max_version is None or row.max_version <= filt.max_version


def _selected(columns: Any, filt: TrajectoryFilter, up_to_id: int) -> Select[Any]:
    return (
        select(*columns)
        .select_from(Trajectory)
        .join(Session, Session.id == Trajectory.session_id)
        .where(and_(Trajectory.id <= up_to_id, *_conditions(filt)))
    )


async def newest_trajectory_id(session_factory: SessionFactory) -> int:
    """The highest trajectory id now (0: none), the end of an export's snapshot: rows written while it
    runs are left for the next one."""
    async with session_factory() as db:
        return int(await db.scalar(select(func.max(Trajectory.id))) or 0)


async def count_candidates(session_factory: SessionFactory, filt: TrajectoryFilter, up_to_id: int) -> int:
    """How many rows up to `up_to_id` match what SQL checks (an upper bound when `max_version` is set)."""
    async with session_factory() as db:
        return int(await db.scalar(_selected([func.count()], filt, up_to_id)) or 0)


_COLUMNS = (
    Trajectory.id, Trajectory.session_id, Trajectory.group_id, Trajectory.token_ids, Trajectory.loss_mask,
    Trajectory.logprobs, Trajectory.versions, Trajectory.reward, Trajectory.temperature,
    Trajectory.min_version, Trajectory.consumed_step, Trajectory.completion_ids, Trajectory.created_at,
    Session.task.label("task"), Session.metadata_.label("session_metadata"),
)


async def candidate_batches(
    session_factory: SessionFactory, filt: TrajectoryFilter, up_to_id: int, batch_size: int
) -> AsyncIterator[list[ExportRow]]:
    """The rows up to `up_to_id` that match what SQL checks, in id order, `batch_size` per query (apply
    `keep` for the rest of the filter)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    after = 0
    while True:
        query = _selected(_COLUMNS, filt, up_to_id).where(Trajectory.id > after)
        async with session_factory() as db:
            rows = (await db.execute(query.order_by(Trajectory.id).limit(batch_size))).all()
        if not rows:
            return
        yield [_row(row) for row in rows]
        if len(rows) < batch_size:
            return
        after = rows[-1].id


def _row(row: Any) -> ExportRow:
    versions = row.versions
    generated = versions[versions >= 0]
    return ExportRow(
        trajectory_id=row.id,
        session_id=row.session_id,
        group_id=row.group_id,
        token_ids=row.token_ids,
        loss_mask=row.loss_mask,
        logprobs=row.logprobs,
        versions=versions,
        reward=float(row.reward),
        temperature=float(row.temperature),
        min_version=int(row.min_version),
        max_version=int(np.max(generated)) if generated.size else int(row.min_version),
        consumed_step=row.consumed_step,
        completion_ids=tuple(row.completion_ids or ()),
        task=row.task,
        metadata=dict(row.session_metadata or {}),
        created_at=as_utc(row.created_at),
    )
