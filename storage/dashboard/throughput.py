"""Throughput from stored timestamps, so every proxy on one database answers the same: completions and
their generated tokens (`completions.created_at`; a packed `<i4` output buffer's bytes over 4), reward
hook jobs settled (`reward_jobs.finished_at`, done or failed) and trajectories written
(`trajectories.created_at`), counted over recent windows ending now and as a series of equal buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from storage.dashboard.sql import bucket_index, dialect_of
from storage.engine import SessionFactory
from storage.models import Completion, JobState, RewardJob, Trajectory
from storage.packing import INT32

MAX_SPAN_S = 7 * 24 * 3600
MAX_BUCKETS = 720


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    """What happened in one window or bucket."""

    completions: int = 0
    output_tokens: int = 0
    hook_jobs: int = 0
    trajectories: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """Counts over each window ending at `now`, and `buckets` equal buckets from `start` to `now`."""

    now: datetime
    windows: dict[int, Counts]  # by window length in seconds
    start: datetime
    bucket_s: float
    series: tuple[Counts, ...]


async def throughput(
    session_factory: SessionFactory, now: datetime, windows_s: Sequence[int], span_s: int, buckets: int
) -> Throughput:
    """Counts over `windows_s` and the series over the last `span_s` seconds (aware `now`)."""
    if not windows_s or min(windows_s) < 1 or max(windows_s) > MAX_SPAN_S:
        raise ValueError(f"windows must be within 1..{MAX_SPAN_S} s")
    if not 1 <= span_s <= MAX_SPAN_S or not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"span must be within 1..{MAX_SPAN_S} s and buckets within 1..{MAX_BUCKETS}")
    start = now - timedelta(seconds=span_s)
    width = span_s / buckets
    settled = RewardJob.state.in_((JobState.DONE.value, JobState.FAILED.value))
    sources: list[tuple[str, Any, Any, Any]] = [
        ("completions", Completion.created_at, func.length(Completion.output_ids), None),
        ("hook_jobs", RewardJob.finished_at, None, settled),
        ("trajectories", Trajectory.created_at, None, None),
    ]
    window_counts: dict[int, dict[str, int]] = {w: {} for w in windows_s}
    series: list[dict[str, int]] = [{} for _ in range(buckets)]
    async with session_factory() as db:
        dialect = dialect_of(db)
        for name, moment, size, condition in sources:
            extra = () if condition is None else (condition,)
            for w, (count, total) in zip(windows_s, await _windows(db, now, windows_s, moment, size, extra),
                                         strict=True):
                _put(window_counts[w], name, count, total)
            bucket = bucket_index(moment, start.timestamp(), width, dialect)
            for index, count, total in await _buckets(db, start, now, moment, size, bucket, extra):
                if 0 <= index < buckets:  # a time on the edge may round past the last bucket
                    _put(series[index], name, count, total)
    return Throughput(
        now=now, windows={w: Counts(**c) for w, c in window_counts.items()}, start=start, bucket_s=width,
        series=tuple(Counts(**c) for c in series),
    )


def _put(counts: dict[str, int], name: str, count: int, total: int | None) -> None:
    counts[name] = counts.get(name, 0) + int(count)
    if name == "completions":
        counts["output_tokens"] = counts.get("output_tokens", 0) + int(total or 0) // INT32.itemsize


async def _windows(
    db: AsyncSession, now: datetime, windows_s: Sequence[int], moment: Any, size: Any, extra: tuple[Any, ...]
) -> list[tuple[int, int]]:
    """(rows, summed size) within each window, in one pass over the rows of the longest."""
    columns: list[Any] = []
    for w in windows_s:
        inside = moment >= now - timedelta(seconds=w)
        columns.append(func.count().filter(inside))
        columns.append(func.coalesce(func.sum(size).filter(inside), 0) if size is not None else literal(0))
    oldest = now - timedelta(seconds=max(windows_s))
    row = (await db.execute(select(*columns).where(moment >= oldest, moment < now, *extra))).one()
    return [(int(row[2 * i] or 0), int(row[2 * i + 1] or 0)) for i in range(len(windows_s))]


async def _buckets(
    db: AsyncSession, start: datetime, now: datetime, moment: Any, size: Any, bucket: Any,
    extra: tuple[Any, ...],
) -> list[tuple[int, int, int]]:
    """(bucket index, rows, summed size) of the buckets that hold any row."""
    inner = (
        select(bucket.label("bucket"), (size if size is not None else literal(0)).label("size"))
        .where(moment >= start, moment < now, *extra)
        .subquery()
    )
    query = select(inner.c.bucket, func.count(), func.coalesce(func.sum(inner.c.size), 0)).group_by(
        inner.c.bucket
    )
    return [(int(index), int(count), int(total)) for index, count, total in await db.execute(query)]
