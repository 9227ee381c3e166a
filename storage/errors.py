"""Telling a database that is down (or dropped its connection) from a statement it refused: the first is
worth waiting out and retrying, the second is the caller's to handle."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import asyncpg
from sqlalchemy import exc as sa_exc

_UNAVAILABLE = (
    asyncpg.PostgresConnectionError,  # refused, lost, rejected
    asyncpg.OperatorInterventionError,  # shutting down, crashed, cannot connect now, cancelled
    asyncpg.TooManyConnectionsError,
    asyncpg.InterfaceError,  # "connection is closed" and the like, raised by the driver itself
    asyncpg.InternalClientError,  # a connection left mid-operation as the server went away
    ConnectionError,
    TimeoutError,
)
_SQLITE_UNAVAILABLE = ("database is locked", "unable to open database", "disk i/o error")


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) says the database could not be reached or lost the connection,
    rather than that it refused the statement (a constraint, a missing table, bad data)."""
    for cause in _chain(exc):
        if isinstance(cause, sa_exc.DBAPIError) and cause.connection_invalidated:
            return True
        if isinstance(cause, _UNAVAILABLE):
            return True
        if isinstance(cause, sqlite3.OperationalError) and str(cause).lower().startswith(_SQLITE_UNAVAILABLE):
            return True
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError | PermissionError):
            return True
    return False


def is_duplicate(exc: BaseException) -> bool:
    """Whether `exc` is a unique-key violation (a row with that key exists already), from any driver."""
    return any(
        isinstance(cause, sa_exc.IntegrityError | sqlite3.IntegrityError | asyncpg.UniqueViolationError)
        for cause in _chain(exc)
    )


SESSION_FINALIZED = "session_finalized"
"""What the database says when a completion would join a finalized session (migration 0006)."""


def is_session_finalized(exc: BaseException) -> bool:
    """Whether `exc` is the database refusing a completion for a session already finalized."""
    return any(SESSION_FINALIZED in str(cause) for cause in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps (a DBAPI error's `orig`) and what caused it, each once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        orig = getattr(current, "orig", None)
        if isinstance(orig, BaseException):
            pending.append(orig)
