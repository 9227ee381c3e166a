"""Alembic, driven from code: upgrade, downgrade and inspect a database's schema revision by URL, and
`ensure_schema`, which every entry point runs before it uses the database."""

from __future__ import annotations

import asyncio
import logging
from importlib.util import find_spec
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import make_url
from sqlalchemy.engine import Connection

from storage.config import StorageConfig, StorageSetupError
from storage.engine import SQLITE_DRIVER, create_engine

logger = logging.getLogger(__name__)


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


class SchemaError(StorageSetupError):
    """The database is not at the schema revision this Flywheel needs; the message says what to run."""


def ensure_schema(config: StorageConfig, *, upgrade_sqlite: bool) -> None:
    """Make sure the database is at this Flywheel's head revision before anything uses it, so an entry
    point fails at once with a message instead of serving errors on a missing table or column.

    With `upgrade_sqlite`, a SQLite database behind head (or empty) is migrated: the embedded default is
    one user's own file, migrated on first use by every command that opens it. Anything else behind
    head (a shared Postgres database, whose migration its operator runs once, `flywheel db upgrade`)
    is a `SchemaError`, as is a database ahead of what this Flywheel knows."""
    url = config.url
    shown = make_url(url).render_as_string(hide_password=True)
    head = head_revision()
    try:
        revision = current(url)
    except Exception as exc:  # any failure to open it: an entry point reports it, not a traceback
        raise SchemaError(f"cannot read the schema revision of {shown}: {type(exc).__name__}: {exc}") from exc
    if revision == head:
        return
    if revision is not None and not _known(revision):
        raise SchemaError(
            f"{shown} is at schema revision {revision}, newer than this Flywheel knows (head {head}): "
            "run a Flywheel at least as new as the one that migrated it"
        )
    if upgrade_sqlite and make_url(url).drivername == SQLITE_DRIVER:
        logger.info("migrating %s from revision %s to %s", shown, revision, head)
        upgrade(url)
        return
    raise SchemaError(
        f"{shown} is at schema revision {revision or 'none (an empty database)'}, and this Flywheel needs "
        f"{head}: run `flywheel db upgrade` with the same storage.url first"
    )


def _known(revision: str) -> bool:
    try:
        return ScriptDirectory.from_config(alembic_config("")).get_revision(revision) is not None
    except CommandError:
        return False
