"""Fixtures of the integration tests: the proxy harness (tests/support/proxy_harness.py) and a local Ray
instance. The database fixtures (`db_url`, `engine`, ...) are in tests/conftest.py.

- `servers`: a `LoopThread` the scripted workers run on.
- `scripted`: one scripted worker with the default token function.
- `worker`: one scripted worker speaking the module's `script` fixture (made with `install_script`).
- `proxies`: a `ProxyFactory` on `db_url` and the tiny model; `proxy`: one proxy in front of `scripted`.
- `ray_cluster`: a local Ray instance for the whole session.
- `hermes_python`: the python of hermes-agent's own venv (`make agents`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

HERMES_PYTHON = Path(__file__).resolve().parents[2] / ".venv-agents" / "hermes" / "bin" / "python"
REQUIRE_AGENTS_ENV = "FLYWHEEL_TEST_REQUIRE_AGENTS"


@pytest.fixture(name="hermes_python")
def hermes_python_fixture() -> Path:
    """hermes-agent pins openai 2.x, so it runs from a venv of its own: skip without it, or fail when
    FLYWHEEL_TEST_REQUIRE_AGENTS=1 (as `make test` and CI set)."""
    if not HERMES_PYTHON.exists():
        reason = f"hermes-agent's venv is missing ({HERMES_PYTHON}): run `make agents`"
        if os.environ.get(REQUIRE_AGENTS_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return HERMES_PYTHON


@pytest.fixture
def servers() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def scripted(servers: LoopThread) -> Iterator[ScriptedWorker]:
    worker = servers.start_scripted()
    yield worker
    servers.call(worker.stop())


@pytest.fixture
def worker(servers: LoopThread, script: TextScript) -> Iterator[ScriptedWorker]:
    """A scripted worker speaking the module's `script` fixture (made with `install_script`)."""
    worker = servers.start_scripted(token_fn=script, eos_token_id=script.eos)
    yield worker
    servers.call(worker.stop())


@pytest.fixture
def proxies(db_url: str, tiny_model_dir: Path) -> Iterator[ProxyFactory]:
    factory = ProxyFactory(db_url, tiny_model_dir)
    with factory.stack:
        yield factory


@pytest.fixture
def proxy(proxies: ProxyFactory, scripted: ScriptedWorker) -> Proxy:
    """A proxy in front of one scripted worker."""
    return proxies.start([scripted.url])


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance: 2 CPUs, no dashboard, a short temp dir (Unix socket paths are short). If Ray
    was started already it is reused, and left running."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp", ignore_cleanup_errors=True) as temp_dir:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _temp_dir=temp_dir,
            configure_logging=False,
            log_to_driver=True,
        )
        try:
            yield
        finally:
            ray.shutdown()
