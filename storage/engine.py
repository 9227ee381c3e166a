"""The one way to open the database: an async engine from a StorageConfig, and its session factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import msgspec
from sqlalchemy import URL, event, make_url
from sqlalchemy.engine import Connection, CursorResult, Result
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from storage.config import StorageConfig

SQLITE_DRIVER = "sqlite+aiosqlite"
POSTGRES_DRIVER = "postgresql+asyncpg"

SessionFactory = async_sessionmaker[AsyncSession]

# Execution option asking the SQLite begin hook for BEGIN IMMEDIATE (take the write lock up front).
_IMMEDIATE = "flywheel_begin_immediate"


def json_text(value: Any) -> str:
    """JSON columns' text (the engines' `json_serializer`): msgspec, several times faster than the
    stdlib's json.dumps on the proxy's request and response objects, with UTF-8 text unescaped and
    NaN/±inf as null (json.dumps writes bare NaN/Infinity, which are not JSON: Postgres refuses them)."""
    return msgspec.json.encode(value).decode()


def create_engine(config: StorageConfig) -> AsyncEngine:
    """An AsyncEngine for `sqlite+aiosqlite` (WAL, busy timeout, foreign keys on) or `postgresql+asyncpg`."""
    url = make_url(config.url)
    if url.drivername == SQLITE_DRIVER:
        return _create_sqlite_engine(url, config)
    if url.drivername == POSTGRES_DRIVER:
        return create_async_engine(
            url, echo=config.echo, pool_size=config.pool_size, json_serializer=json_text
        )
    raise ValueError(
        f"storage.url must start with {SQLITE_DRIVER}:/// or {POSTGRES_DRIVER}://, got {url.drivername}://"
    )


def create_sessionmaker(engine: AsyncEngine) -> SessionFactory:
    """Sessions whose loaded rows stay readable after commit (no lazy reloads under asyncio)."""
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def write_transaction(session_factory: SessionFactory) -> AsyncIterator[AsyncSession]:
    """A transaction that will write, committed on success and rolled back on any error.

    On SQLite it starts with BEGIN IMMEDIATE: writers queue on the busy timeout instead of failing
    with 'database is locked' when they upgrade a read snapshot another writer has made stale, and
    a read-then-write (a claim) sees no other writer in between. Postgres starts a plain BEGIN.
    """
    async with session_factory() as session:
        await session.connection(execution_options={_IMMEDIATE: True})
        yield session
        await session.commit()


def affected_rows(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (its result is always a CursorResult)."""
    return cast(CursorResult[Any], result).rowcount


def _create_sqlite_engine(url: URL, config: StorageConfig) -> AsyncEngine:
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        raise ValueError(
            "storage.url needs a SQLite file (sqlite+aiosqlite:///path/to/flywheel.db): an in-memory "
            "database is private to one connection, and the proxy and trainer share this one"
        )
    if not url.query.get("uri"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, echo=config.echo, pool_size=config.pool_size, json_serializer=json_text)
    busy_timeout_ms = config.sqlite_busy_timeout_ms
    synchronous = config.sqlite_synchronous

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control from the sqlite3 driver (it skips BEGIN before SELECT and DDL);
        # on_begin below emits BEGIN itself, per SQLAlchemy's documented recipe.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    def on_begin(connection: Connection) -> None:
        immediate = connection.get_execution_options().get(_IMMEDIATE, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    event.listen(engine.sync_engine, "connect", on_connect)
    event.listen(engine.sync_engine, "begin", on_begin)
    return engine
