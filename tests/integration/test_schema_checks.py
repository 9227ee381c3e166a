"""Every entry point checks the schema before it uses the database (storage/migrate.py `ensure_schema`):
the embedded SQLite default is migrated on first use; a Postgres database behind this Flywheel's schema
(or without a key secret) makes `flywheel proxy`, `trainer` and `keys` exit at once with what to run,
and the proxy app itself refuses to start rather than serve errors on a missing table."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import make_url

from proxy.app import create_proxy_app
from proxy.config import ProxyConfig
from serving.config import ServingConfig
from storage.migrate import SchemaError, current, head_revision, upgrade
from tests.support.cli import flywheel
from tests.support.databases import run_outside_loop, storage_config, storage_overrides
from tests.support.proxy_harness import dead_worker_url


def test_keys_create_admin_on_a_fresh_sqlite_default_migrates_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "never-used-run"
    created = flywheel("keys", "create", "--admin", f"run.dir={run_dir}", cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    assert created.stdout.strip().splitlines()[-1].startswith("fw-admin-")
    database = run_dir / "flywheel.db"
    assert run_outside_loop(current, f"sqlite+aiosqlite:///{database}") == head_revision()
    assert (run_dir / "flywheel.db.key-secret").stat().st_mode & 0o777 == 0o600
    listed = flywheel("keys", "list", f"run.dir={run_dir}", cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == ["1", "admin"]


def test_keys_on_an_empty_database_migrate_sqlite_and_refuse_postgres(
    empty_db_url: str, tmp_path: Path
) -> None:
    result = flywheel("keys", "list", *storage_overrides(empty_db_url), cwd=tmp_path)
    if make_url(empty_db_url).get_backend_name() == "sqlite":
        assert result.returncode == 0, result.stderr
        assert run_outside_loop(current, empty_db_url) == head_revision()
        return
    assert result.returncode == 1 and "`flywheel db upgrade`" in result.stderr
    assert "Traceback" not in result.stderr
    assert run_outside_loop(current, empty_db_url) is None  # refused, not migrated behind its operator's back


@pytest.mark.postgres
@pytest.mark.parametrize("revision", [None, "0003"])
def test_entry_points_exit_at_once_on_a_postgres_database_behind_the_schema(
    empty_postgres_url: str, revision: str | None, tmp_path: Path
) -> None:
    if revision is not None:
        run_outside_loop(upgrade, empty_postgres_url, revision)
    for command in (["proxy"], ["trainer"], ["keys", "create", "--admin"]):
        result = flywheel(*command, *storage_overrides(empty_postgres_url), cwd=tmp_path, timeout=60)
        assert result.returncode == 1, (command, result.stderr)
        assert "run `flywheel db upgrade`" in result.stderr, (command, result.stderr)
        assert f"revision {revision or 'none'}" in result.stderr and head_revision() in result.stderr
        assert "Traceback" not in result.stderr
    assert run_outside_loop(current, empty_postgres_url) == revision


@pytest.mark.postgres
def test_postgres_without_a_key_secret_refuses_what_hashes_keys(
    empty_postgres_url: str, tmp_path: Path
) -> None:
    run_outside_loop(upgrade, empty_postgres_url)
    for command in (["keys", "create", "--admin"], ["proxy"]):
        result = flywheel(*command, f"storage.url={empty_postgres_url}", cwd=tmp_path, timeout=60)
        assert result.returncode == 1 and "FLYWHEEL_STORAGE__KEY_SECRET" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    listed = flywheel("keys", "list", f"storage.url={empty_postgres_url}", cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr  # listing and revoking hash nothing


async def test_the_proxy_app_refuses_to_start_on_a_database_behind_the_schema(
    empty_db_url: str, tiny_model_dir: Path
) -> None:
    serving = ServingConfig(model=str(tiny_model_dir), worker_urls=[dead_worker_url()])
    app = create_proxy_app(ProxyConfig(), storage_config(empty_db_url), serving)
    with pytest.raises(SchemaError, match="flywheel db upgrade"):
        async with app.router.lifespan_context(app):
            pass
    assert run_outside_loop(current, empty_db_url) is None
