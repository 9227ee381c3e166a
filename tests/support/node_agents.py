"""Where the Node agents' CLIs (Codex, OpenClaw) are: `make agents` installs Node 24 and them under
.venv-agents/node; `FLYWHEEL_TEST_NODE_AGENTS` names another npm prefix holding the same packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = REPO / ".venv-agents" / "node"
PREFIX_ENV = "FLYWHEEL_TEST_NODE_AGENTS"
REQUIRE_AGENTS_ENV = "FLYWHEEL_TEST_REQUIRE_AGENTS"


def node_prefix() -> Path:
    """The npm prefix the agents are installed under."""
    return Path(os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX)


def node_bin_dir() -> Path:
    """The prefix's node_modules/.bin (node itself and the CLIs' launchers), which may not exist."""
    return node_prefix() / "node_modules" / ".bin"


def node_agent(name: str) -> Path:
    """The launcher of CLI `name` (with `node` beside it): skip the test when it is missing, or fail when
    FLYWHEEL_TEST_REQUIRE_AGENTS=1 (as `make test` and CI set)."""
    path = node_bin_dir() / name
    missing = [p for p in (path, node_bin_dir() / "node") if not p.exists()]
    if missing:
        reason = f"{', '.join(map(str, missing))} missing: run `make agents` (or set {PREFIX_ENV})"
        if os.environ.get(REQUIRE_AGENTS_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def node_env(**extra: str) -> dict[str, str]:
    """This process's environment with the prefix's node_modules/.bin first on PATH (the CLIs need the
    Node installed beside them), plus `extra`."""
    path = f"{node_bin_dir()}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, **extra}
