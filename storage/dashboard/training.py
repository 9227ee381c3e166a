"""What training did: the policy versions with the steps that produced them, and staleness histograms.

Staleness is what the trainer reports as `staleness/*` (trainer/step_stats.py): a sample's lag is the
version it is trained from minus the oldest version among its generated tokens (`min_version`). For a
consumed sample that is the step's parent version (`policy_versions.parent_version`, else the version
before the step's); for a waiting one (neither consumed nor dropped) the current version: the served
one, else the newest recorded, else 0. A sample newer than the current version (its tokens came from a
version not yet marked served) counts as lag 0. Histograms group by plain columns and compute lags here,
so the SQL is the same on both backends and reads indexes: consumed samples of the last steps through
`consumed_step`, waiting ones through the unconsumed partial index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from storage.engine import SessionFactory
from storage.models import PolicyVersion, TrainStep, Trajectory, as_utc
from storage.policy_versions import newest_version, served_version

MAX_VERSIONS = 1_000
MAX_STEPS = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionRow:
    """A policy version, its evaluation and promotion, and the step that trained it (none for version 0
    or a step not recorded)."""

    version: int
    status: str
    parent_version: int | None
    eval_score: float | None
    eval_items: int
    reason: str | None
    served_at: datetime | None
    created_at: datetime
    step: int | None
    step_metrics: dict[str, Any] = field(default_factory=dict)


async def version_rows(session_factory: SessionFactory, limit: int) -> tuple[list[VersionRow], bool]:
    """The `limit` newest versions, newest first, and whether older ones were left out."""
    if not 1 <= limit <= MAX_VERSIONS:
        raise ValueError(f"limit must be within 1..{MAX_VERSIONS}")
    query = (
        select(PolicyVersion, TrainStep.step, TrainStep.metrics)
        .outerjoin(TrainStep, TrainStep.policy_version == PolicyVersion.version)
        .order_by(PolicyVersion.version.desc(), TrainStep.step.desc())
        .limit(limit + 1)
    )
    async with session_factory() as db:
        rows = (await db.execute(query)).all()
    versions: list[VersionRow] = []
    for pv, step, metrics in rows[:limit]:
        if versions and versions[-1].version == pv.version:
            continue  # a version has one step; a second would be a resumed run's record
        versions.append(VersionRow(
            version=pv.version, status=pv.status, parent_version=pv.parent_version, eval_score=pv.eval_score,
            eval_items=len((pv.eval_details or {}).get("items") or {}), reason=pv.reason,
            served_at=None if pv.served_at is None else as_utc(pv.served_at),
            created_at=as_utc(pv.created_at), step=step, step_metrics=dict(metrics or {}),
        ))
    return versions, len(rows) > limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Staleness:
    """Samples by lag (versions behind), trained ones over the last `steps` steps and waiting ones now."""

    current_version: int
    steps: int  # steps the trained histogram covers (from `first_step` to the last step)
    first_step: int | None
    trained: dict[int, int]
    waiting: dict[int, int]


async def current_version(session_factory: SessionFactory) -> int:
    """The version staleness is measured against now: served, else newest recorded, else 0."""
    found = await served_version(session_factory) or await newest_version(session_factory)
    return 0 if found is None else found.version


async def staleness(session_factory: SessionFactory, steps: int) -> Staleness:
    """The histograms, trained ones over the last `steps` steps."""
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be within 1..{MAX_STEPS}")
    current = await current_version(session_factory)
    async with session_factory() as db:
        last_step = await db.scalar(select(func.max(TrainStep.step)))
        first_step = None if last_step is None else max(int(last_step) - steps + 1, 0)
        trained: dict[int, int] = {}
        if first_step is not None:
            query = (
                select(PolicyVersion.parent_version, TrainStep.policy_version, Trajectory.min_version,
                       func.count())
                .select_from(Trajectory)
                .join(TrainStep, TrainStep.step == Trajectory.consumed_step)
                .outerjoin(PolicyVersion, PolicyVersion.version == TrainStep.policy_version)
                .where(Trajectory.consumed_step >= first_step)
                .group_by(PolicyVersion.parent_version, TrainStep.policy_version, Trajectory.min_version)
            )
            for parent, produced, oldest, count in await db.execute(query):
                base = parent if parent is not None else produced - 1
                _add(trained, base - oldest, count)
        waiting: dict[int, int] = {}
        pending = (
            select(Trajectory.min_version, func.count())
            .where(Trajectory.consumed_step.is_(None), Trajectory.dropped_at.is_(None))
            .group_by(Trajectory.min_version)
        )
        for oldest, count in await db.execute(pending):
            _add(waiting, current - oldest, count)
    return Staleness(current_version=current, steps=steps, first_step=first_step, trained=trained,
                     waiting=waiting)


def _add(histogram: dict[int, int], lag: int, count: int) -> None:
    lag = max(int(lag), 0)
    histogram[lag] = histogram.get(lag, 0) + int(count)
