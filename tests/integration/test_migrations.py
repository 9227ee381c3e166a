"""Alembic owns the schema: migrations go up, down to nothing and up again, and agree with the models."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, MetaData, String, inspect
from sqlalchemy.engine import Connection

from storage.config import StorageConfig
from storage.engine import create_engine
from storage.migrate import current, downgrade, head_revision, upgrade
from storage.models import Base
from tests.support.databases import run_outside_loop

TABLES = {
    "api_keys",
    "groups",
    "sessions",
    "completions",
    "rewards",
    "reward_jobs",
    "feedback",
    "trajectories",
    "policy_versions",
    "train_steps",
    "key_usage",
}


def _inspect(url: str, fn: Any) -> Any:
    async def go() -> Any:
        engine = create_engine(StorageConfig(url=url))
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(fn)
        finally:
            await engine.dispose()

    return run_outside_loop(lambda: asyncio.run(go()))


def _tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names()) - {"alembic_version"}


def _diff(metadata: MetaData) -> Any:
    def compare(connection: Connection) -> list[Any]:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, metadata)

    return compare


def test_upgrade_downgrade_upgrade(empty_db_url: str) -> None:
    assert run_outside_loop(current, empty_db_url) is None
    run_outside_loop(upgrade, empty_db_url)
    assert run_outside_loop(current, empty_db_url) == head_revision()
    assert _inspect(empty_db_url, _tables) == TABLES

    run_outside_loop(downgrade, empty_db_url, "base")
    assert run_outside_loop(current, empty_db_url) is None
    assert _inspect(empty_db_url, _tables) == set()

    run_outside_loop(upgrade, empty_db_url)
    assert run_outside_loop(current, empty_db_url) == head_revision()
    assert _inspect(empty_db_url, _tables) == TABLES


def test_models_match_migrations(db_url: str) -> None:
    assert _inspect(db_url, _diff(Base.metadata)) == []


def test_drift_is_detected(db_url: str) -> None:
    # The check above is only worth something if a model change without a migration shows up.
    drifted = MetaData(naming_convention=Base.metadata.naming_convention)
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["sessions"].append_column(Column("note", String(10), nullable=True))
    drifted.tables["groups"].c.task.type = String(5)
    diff = _inspect(db_url, _diff(drifted))
    assert [d[0] for d in diff if isinstance(d, tuple)] == ["add_column"]
    assert any(isinstance(d, list) and d[0][0] == "modify_type" for d in diff)


@pytest.mark.parametrize("url", ["mysql+aiomysql://u@h/db", "sqlite:///plain-sync-driver.db"])
def test_unsupported_url_is_rejected(url: str) -> None:
    with pytest.raises(ValueError, match=r"unsupported database"):
        run_outside_loop(upgrade, url)
