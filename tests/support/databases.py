"""Scratch databases for tests: which Postgres server to use, and the blocking calls that probe it and
create and drop databases on it, run away from pytest-asyncio's event loop; the storage config (and key
hasher) every process of a test shares on one database. The fixtures built on them (`postgres_server_url`,
`empty_db_url`, `db_url`, ...) are in tests/conftest.py."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from storage.config import StorageConfig
from storage.keys import KeyHasher, load_key_hasher

POSTGRES_URL_ENV = "FLYWHEEL_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "FLYWHEEL_TEST_REQUIRE_POSTGRES"
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
TEST_KEY_SECRET = "flywheel-tests-key-secret-not-for-production"
"""The key secret of the tests' Postgres databases, which need one set (storage/keys.py)."""


def storage_config(db_url: str) -> StorageConfig:
    """The storage config a test's processes share on `db_url`: Postgres with TEST_KEY_SECRET, SQLite
    without one, so that the secret generated beside the database file is what its processes share."""
    if make_url(db_url).get_backend_name() == "sqlite":
        return StorageConfig(url=db_url)
    return StorageConfig(url=db_url, key_secret=TEST_KEY_SECRET)


def storage_overrides(db_url: str) -> list[str]:
    """`storage_config(db_url)` as `flywheel` command-line overrides."""
    secret = storage_config(db_url).key_secret
    if secret is None:
        return [f"storage.url={db_url}"]
    return [f"storage.url={db_url}", f"storage.key_secret={secret.get_secret_value()}"]


def key_hasher(db_url: str) -> KeyHasher:
    """The hasher the proxy and the CLI use on `db_url` (for SQLite, this reads or makes the secret file)."""
    return load_key_hasher(storage_config(db_url))


def key_hash(key: str) -> str:
    """A keyed hash to store for `key` where no process ever checks the key (rows made directly)."""
    return KeyHasher(TEST_KEY_SECRET.encode()).hash(key)


def run_outside_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking setup (its own asyncio.run, e.g. Alembic's env.py) on a worker thread, so it never
    meets pytest-asyncio's event loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def run_coroutine_outside_loop(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """`asyncio.run(coro_fn())` on a worker thread (see `run_outside_loop`)."""
    return run_outside_loop(lambda: asyncio.run(coro_fn()))


@contextmanager
def scratch_postgres_database(server_url: str) -> Iterator[str]:
    """A new empty database `flywheel_t_<random>` on the server of `server_url`, dropped afterwards."""
    name = f"flywheel_t_{secrets.token_hex(6)}"
    run_coroutine_outside_loop(lambda: execute_autocommit(server_url, f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        run_coroutine_outside_loop(
            lambda: execute_autocommit(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        )


async def execute_autocommit(server_url: str, sql: str) -> None:
    """One statement outside any transaction (CREATE and DROP DATABASE need that)."""
    engine = create_async_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.exec_driver_sql(sql)
    finally:
        await engine.dispose()


async def unreachable_because(server_url: str) -> str | None:
    """Why the server cannot be reached (refused, no route, no answer), or None if it answers. A bad
    login still raises."""
    try:
        await asyncio.wait_for(execute_autocommit(server_url, "SELECT 1"), timeout=5)
    except (OSError, TimeoutError) as error:
        return f"{type(error).__name__}: {error}"
    return None
