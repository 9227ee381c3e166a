"""House rules CI enforces: ruff on the whole tree, mypy on every package, and the import contracts of
pyproject.toml (the layers of docs/architecture.md, "Layers and folders", and no import cycles)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flywheel", "proxy", "serving", "storage", "rewards", "trainer", "integrations", "migrations")
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def run(*command: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    result = run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout[-4000:]


def test_mypy_is_clean():
    result = run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout[-4000:]


def test_import_contracts_hold():
    result = run(LINT_IMPORTS)
    assert result.returncode == 0, result.stdout[-4000:]


def test_an_import_cycle_breaks_the_contracts(tmp_path: Path):
    """The contracts can fail: a copy of the tree where the workers import the call pipeline (which
    imports them) is refused, as a cycle and as a lower layer importing a higher one."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "proxy" / "workers" / "plan.py", "a") as module:
        module.write("\nimport proxy.openai.pipeline  # noqa: E402, F401\n")
    result = run(LINT_IMPORTS, cwd=tmp_path)
    assert result.returncode != 0
    assert "No import cycles among the modules of any package BROKEN" in result.stdout
    assert "proxy.workers.plan -> proxy.openai.pipeline" in result.stdout
