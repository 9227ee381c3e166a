"""Database fixtures for integration tests: every test gets a fresh database, on SQLite and on Postgres,
whose schema is built by running the Alembic migrations.

- `empty_db_url`: a fresh, empty database (a SQLite file in tmp_path, or a scratch Postgres database
  `flywheel_t_<random>` created on the server of FLYWHEEL_TEST_POSTGRES_URL and dropped afterwards).
- `db_url`: the same, migrated to head.
- `engine`, `session_factory`: storage's AsyncEngine and session factory on `db_url`.

Postgres cases skip, with the reason, only when the server is unreachable; with
FLYWHEEL_TEST_REQUIRE_POSTGRES=1 (CI) they fail instead.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.migrate import upgrade

POSTGRES_URL_ENV = "FLYWHEEL_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "FLYWHEEL_TEST_REQUIRE_POSTGRES"
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


def run_outside_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking setup (its own asyncio.run, e.g. Alembic's env.py) on a worker thread, so it never
    meets pytest-asyncio's event loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def _run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return run_outside_loop(lambda: asyncio.run(coro_fn()))


async def _execute_autocommit(server_url: str, sql: str) -> None:
    engine = create_async_engine(server_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.exec_driver_sql(sql)
    finally:
        await engine.dispose()


async def _probe(server_url: str) -> str | None:
    try:
        await asyncio.wait_for(_execute_autocommit(server_url, "SELECT 1"), timeout=5)
    except (OSError, TimeoutError) as error:  # refused, no route, no answer; a bad login still fails
        return f"{type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """A Postgres server URL we may CREATE DATABASE on."""
    url = os.environ.get(POSTGRES_URL_ENV, DEFAULT_POSTGRES_URL)
    error = _run(lambda: _probe(url))
    if error is not None:
        shown = make_url(url).render_as_string(hide_password=True)
        reason = f"Postgres unreachable at {shown} ({error}); set {POSTGRES_URL_ENV} to a server"
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A fresh empty database: a SQLite file, or a scratch Postgres database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
        return
    server_url = request.getfixturevalue("postgres_server_url")
    name = f"flywheel_t_{secrets.token_hex(6)}"
    _run(lambda: _execute_autocommit(server_url, f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _run(lambda: _execute_autocommit(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A fresh database migrated to head."""
    run_outside_loop(upgrade, empty_db_url)
    return empty_db_url


@pytest.fixture
def backend(db_url: str) -> str:
    """The dialect of this test's database: "sqlite" or "postgresql"."""
    return make_url(db_url).get_backend_name()


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(StorageConfig(url=db_url))
    yield engine
    await engine.dispose()


@pytest.fixture
def session_factory(engine: AsyncEngine) -> SessionFactory:
    return create_sessionmaker(engine)
