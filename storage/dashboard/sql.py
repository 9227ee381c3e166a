"""SQL pieces the dashboard's queries share: seconds since the epoch of a stored time and its bucket in
a time series, written for each backend (SQLite stores UTC times as text, Postgres as timestamptz), and
`IN` lists cut to a size every driver takes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Double, Integer, cast, func, literal
from sqlalchemy.ext.asyncio import AsyncSession

T = TypeVar("T")

IN_CHUNK = 500
"""Ids per `IN (…)` list: well under SQLite's and asyncpg's bound-parameter limits."""

_UNIX_EPOCH_JULIAN_DAY = 2440587.5


def dialect_of(db: AsyncSession) -> str:
    """"sqlite" or "postgresql": the backend of this db session."""
    return db.get_bind().dialect.name


def epoch_seconds(column: Any, dialect: str) -> ColumnElement[float]:
    """Seconds since 1970-01-01 UTC of a stored (UTC) time, as a float."""
    if dialect == "sqlite":
        return (func.julianday(column) - literal(_UNIX_EPOCH_JULIAN_DAY)) * literal(86400.0)
    return cast(func.extract("epoch", column), Double())


def bucket_index(column: Any, start_epoch: float, width_s: float, dialect: str) -> ColumnElement[int]:
    """Which `width_s`-second bucket from `start_epoch` a time falls in (0 for the first; the caller keeps
    times before `start_epoch` out, so the value is never negative and truncation is a floor)."""
    offset = (epoch_seconds(column, dialect) - literal(float(start_epoch))) / literal(float(width_s))
    if dialect == "sqlite":
        return cast(offset, Integer)
    return cast(func.floor(offset), Integer)


def chunks(items: Sequence[T], size: int = IN_CHUNK) -> Iterator[Sequence[T]]:
    """`items` in consecutive slices of at most `size`."""
    for start in range(0, len(items), size):
        yield items[start:start + size]

