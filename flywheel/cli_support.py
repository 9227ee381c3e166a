"""Shared pieces of the operator's read-only commands (`flywheel status`, `sessions`, `export`): opening
the database to read it, times given on the command line, and plain-text tables."""

from __future__ import annotations

import argparse
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from storage.config import StorageConfig, StorageSetupError
from storage.engine import SessionFactory

MOMENT_HELP = "an ISO 8601 date or time (UTC unless it names a zone), or a time ago: 30s, 15m, 2h, 7d"
_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_moment(text: str, now: datetime | None = None) -> datetime:
    """A point in time, aware and in UTC: an ISO 8601 date (its midnight) or time (UTC when it names no
    zone), or a duration before `now`: `30s`, `15m`, `2h`, `7d`. An argparse `type`."""
    ago = _AGO.match(text.strip())
    if ago:
        return (now or datetime.now(UTC)) - timedelta(seconds=float(ago[1]) * _UNIT_S[ago[2]])
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time: use {MOMENT_HELP}") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def positive_int(text: str) -> int:
    """An argparse `type`: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_database(storage: StorageConfig) -> None:
    """Before reading: a SQLite file that does not exist is an error (nothing was recorded there, or
    storage.url points elsewhere) rather than a new empty database; any other database must be at this
    Flywheel's schema (the embedded SQLite default is migrated, as other commands do)."""
    from sqlalchemy import make_url

    from storage.engine import SQLITE_DRIVER
    from storage.migrate import ensure_schema

    url = make_url(storage.url)
    if url.drivername == SQLITE_DRIVER and url.database and not Path(url.database).exists():
        raise StorageSetupError(f"no database at {url.database}: nothing was recorded there (set storage.url "
                                "or run.dir to the run's, or pass the run's config with -c)")
    ensure_schema(storage, upgrade_sqlite=True)


@asynccontextmanager
async def opened(storage: StorageConfig) -> AsyncIterator[SessionFactory]:
    """A session factory on the configured database, its engine disposed of afterwards."""
    from storage.engine import create_engine, create_sessionmaker

    engine = create_engine(storage)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the first is the header) as left-aligned columns two spaces apart."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                     for row in rows)


def iso(moment: datetime | None) -> str | None:
    """A time as ISO 8601 in UTC (what `--json` prints), None for none."""
    return None if moment is None else moment.astimezone(UTC).isoformat()


def at_text(iso_text: str | None) -> str:
    """An ISO 8601 time as `YYYY-MM-DD HH:MM:SS` (UTC), `-` for none."""
    if iso_text is None:
        return "-"
    return f"{datetime.fromisoformat(iso_text).astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def number_text(value: float | None) -> str:
    """A value to four significant digits, `-` for none."""
    return "-" if value is None else f"{value:.4g}"
