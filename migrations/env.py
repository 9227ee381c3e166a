"""Alembic environment: runs migrations on an async engine made by storage.engine (run_sync pattern).

The URL comes from `config.attributes["url"]` (storage.migrate builds the config in code) or, for
developers running the `alembic` command with migrations/alembic.ini, from `sqlalchemy.url`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection

from storage.config import StorageConfig
from storage.engine import create_engine
from storage.models import Base
from storage.types import Float32Array, Int32Array, MaskArray

config = context.config
target_metadata = Base.metadata

_PACKED_ARRAYS = (Int32Array, Float32Array, MaskArray)


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: pass one to storage.migrate or set sqlalchemy.url")
    return str(url)


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    # Migrations stay valid when storage/types.py changes: packed arrays are plain binary columns.
    if type_ == "type" and isinstance(obj, _PACKED_ARRAYS):
        return "sa.LargeBinary()"
    return False


def _configure(**kwargs: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can only ALTER through batch (copy-and-move) operations
        compare_type=True,
        render_item=_render_item,
        **kwargs,
    )


def run_migrations_offline() -> None:
    _configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    # storage's engine emits BEGIN itself on SQLite, so each migration's DDL is one transaction there too.
    engine = create_engine(StorageConfig(url=_url()))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
