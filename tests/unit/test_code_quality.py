"""House rules CI enforces: ruff on the whole tree, mypy on storage/, proxy/ and rewards/ (STYLE.md)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_is_clean():
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout[-4000:]
