"""Scratch databases for tests: which Postgres server to use, and the blocking calls that probe it and
create and drop databases on it, run away from pytest-asyncio's event loop. The fixtures built on them
(`postgres_server_url`, `empty_db_url`, `db_url`, ...) are in tests/conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

POSTGRES_URL_ENV = "FLYWHEEL_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "FLYWHEEL_TEST_REQUIRE_POSTGRES"
DEFAULT_POSTGRES_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


def run_outside_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking setup (its own asyncio.run, e.g. Alembic's env.py) on a worker thread, so it never
    meets pytest-asyncio's event loop."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def run_coroutine_outside_loop(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """`asyncio.run(coro_fn())` on a worker thread (see `run_outside_loop`)."""
    return run_outside_loop(lambda: asyncio.run(coro_fn()))


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
