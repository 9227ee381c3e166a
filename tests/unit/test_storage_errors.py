"""Which database failures are an outage to wait out (storage/errors.py), and which are the statement's."""

from __future__ import annotations

import sqlite3

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc

from storage.errors import is_duplicate, is_unavailable


def _wrapped(orig: BaseException) -> sa_exc.DBAPIError:
    """An error as SQLAlchemy raises it around the driver's."""
    try:
        raise sa_exc.OperationalError("SELECT 1", {}, orig) from orig
    except sa_exc.OperationalError as exc:
        return exc


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(111, "Connection refused"),
    _wrapped(ConnectionRefusedError(111, "Connection refused")),
    asyncpg.CannotConnectNowError("the database system is starting up"),
    asyncpg.AdminShutdownError("terminating connection due to administrator command"),
    asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.InterfaceError("connection is closed"),
    _wrapped(sqlite3.OperationalError("database is locked")),
    TimeoutError(),
], ids=lambda exc: type(exc).__name__)
def test_outages_are_unavailable(exc: BaseException) -> None:
    assert is_unavailable(exc)


@pytest.mark.parametrize("exc", [
    _wrapped(sqlite3.OperationalError("no such table: sessions")),
    asyncpg.UniqueViolationError("duplicate key value"),
    sqlite3.IntegrityError("UNIQUE constraint failed: completions.id"),
    ValueError("bad data"),
    FileNotFoundError("/nowhere/flywheel.db"),
], ids=lambda exc: type(exc).__name__)
def test_refused_statements_are_not_outages(exc: BaseException) -> None:
    assert not is_unavailable(exc)


def test_duplicates_are_recognised_through_any_driver() -> None:
    assert is_duplicate(asyncpg.UniqueViolationError("duplicate key value"))
    assert is_duplicate(sqlite3.IntegrityError("UNIQUE constraint failed: completions.id"))
    assert not is_duplicate(asyncpg.AdminShutdownError("terminating connection"))
