"""Alembic, driven from code: upgrade, downgrade and inspect a database's schema revision by URL."""

from __future__ import annotations

import asyncio
from importlib.util import find_spec
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from storage.config import StorageConfig
from storage.engine import create_engine


def alembic_config(url: str) -> Config:
    """An Alembic Config for `url`, pointing at the installed `migrations` package; no alembic.ini."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser interpolates %
    config.attributes["url"] = url
    return config


def migrations_dir() -> Path:
    """The installed `migrations` package folder (found without importing it, so it also works from an
    editable install where the package resolves as a namespace)."""
    spec = find_spec("migrations")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "env.py").is_file():
            return Path(location)
    raise RuntimeError("the flywheel `migrations` package is not installed next to `storage`")


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision`. Runs its own event loop: call it from sync code."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Migrate the database at `url` down to `revision` ("base" drops every table)."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    """The newest revision the installed migrations know."""
    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    if head is None:
        raise RuntimeError("the migrations package has no revisions")
    return head


def current(url: str) -> str | None:
    """The revision the database at `url` is at; None for an empty database."""
    return asyncio.run(_current(url))


async def _current(url: str) -> str | None:
    engine = create_engine(StorageConfig(url=url))
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(_revision_of)
    finally:
        await engine.dispose()


def _revision_of(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()
