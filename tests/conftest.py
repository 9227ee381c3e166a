"""Fixtures every kind of test may use: the tiny test model, sglang 0.5.23's own wire schema, and fresh
databases, on SQLite and on Postgres, whose schema is built by running the Alembic migrations.

- `empty_db_url`: a fresh, empty database (a SQLite file in tmp_path, or a scratch Postgres database
  `flywheel_t_<random>` created on the server of FLYWHEEL_TEST_POSTGRES_URL and dropped afterwards);
  `empty_postgres_url`: only the latter.
- `db_url`: the same, migrated to head.
- `engine`, `session_factory`: storage's AsyncEngine and session factory on `db_url`.

Postgres cases skip, with the reason, only when the server is unreachable; with
FLYWHEEL_TEST_REQUIRE_POSTGRES=1 (CI) they fail instead. The fixtures of the proxy's integration tests
are in tests/integration/conftest.py.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.migrate import upgrade
from tests.support.databases import (
    DEFAULT_POSTGRES_URL,
    POSTGRES_URL_ENV,
    REQUIRE_POSTGRES_ENV,
    run_coroutine_outside_loop,
    run_outside_loop,
    scratch_postgres_database,
    unreachable_because,
)

# Ray 2.60 writes an auth token under ~/.ray unless told otherwise; tests never want that.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1M-parameter Qwen2-style model with a local BPE tokenizer and a ChatML+tools template."""
    from serving.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def sglang_api_types() -> ModuleType:
    """sglang 0.5.23's `api_types.py`, loaded by path (it needs only msgspec)."""
    from tests.support.sglang_schema import load_api_types

    try:
        return load_api_types()
    except Exception as exc:  # the wheel may be unreachable; say why and skip
        pytest.skip(f"sglang 0.5.23 wheel could not be downloaded: {exc}")


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """A Postgres server URL we may CREATE DATABASE on."""
    url = os.environ.get(POSTGRES_URL_ENV, DEFAULT_POSTGRES_URL)
    error = run_coroutine_outside_loop(lambda: unreachable_because(url))
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
    with scratch_postgres_database(request.getfixturevalue("postgres_server_url")) as url:
        yield url


@pytest.fixture
def empty_postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh empty Postgres database, dropped afterwards, for what only Postgres does (the test is
    marked `postgres`)."""
    with scratch_postgres_database(postgres_server_url) as url:
        yield url


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
