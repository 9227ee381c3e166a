"""`flywheel db upgrade|current|downgrade` as a user runs them, on SQLite and Postgres."""

import subprocess
import sys

from storage.migrate import head_revision


def flywheel(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flywheel.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_db_upgrade_current_downgrade(empty_db_url, tmp_path):
    url = f"storage.url={empty_db_url}"
    result = flywheel("db", "current", url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("at revision None")

    result = flywheel("db", "upgrade", url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"at revision {head_revision()}")
    assert "INFO" not in result.stderr  # alembic's set-up chatter stays quiet

    result = flywheel("db", "downgrade", "--revision", "base", url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("at revision None")


def test_db_rejects_unknown_database_url(tmp_path):
    result = flywheel("db", "upgrade", "storage.url=mysql://root@127.0.0.1/test", cwd=tmp_path)
    assert result.returncode != 0
    assert "mysql" in result.stderr
