"""A hook runner's /metrics, served as `flywheel rewards run --metrics-port` serves it: the jobs it holds
move up while a grader runs and back down once it is done, and runs and failures are counted by source."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import start_http_server

from rewards.config import HookRunnerConfig
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec, stored_hooks
from rewards.metrics import HookMetrics
from rewards.runner import HookRunner
from storage.engine import SessionFactory
from storage.queries import create_session, end_session
from storage.records import SessionRecord
from tests.support.hook_inputs import NoPool
from tests.support.metrics_readers import Samples, scrape, value

HOOKS = "tests.support.metrics_hooks"


async def _ended_session(session_factory: SessionFactory, hook: str, name: str, **metadata: str) -> None:
    spec = HookSpec(hook=f"{HOOKS}:{hook}", name=name, max_attempts=1)
    record = SessionRecord(id=f"sess-{name}-{secrets.token_hex(4)}", key_hash=secrets.token_hex(32),
                           metadata=metadata, reward_hooks=stored_hooks([spec], default_max_attempts=1))
    await create_session(session_factory, record)
    assert await end_session(session_factory, record.id)


async def _scrape_until(url: str, ready: Callable[[Samples], object], what: str) -> Samples:
    deadline = time.monotonic() + 30
    while True:
        samples = await asyncio.to_thread(scrape, url)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
async def test_jobs_in_flight_runs_and_failures_move(session_factory: SessionFactory, tmp_path: Path) -> None:
    metrics = HookMetrics()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        assert value(scrape(url), "flywheel_reward_hook_jobs_in_flight") == 0
        gate = tmp_path / "gate"
        await _ended_session(session_factory, "held_until_gate", "held", gate=str(gate))
        await _ended_session(session_factory, "broken", "broken")
        config = HookRunnerConfig(concurrency=4, poll_interval_s=0.05, backoff_s=0.0)
        runner = HookRunner(session_factory, HookRegistry.built_in(), config, metrics=metrics, pool=NoPool())
        async with runner.running():
            held = await _scrape_until(
                url, lambda s: value(s, "flywheel_reward_hook_jobs_in_flight") == 1
                and value(s, "flywheel_reward_hook_failures_total", source="hook:broken"),
                "the broken job to fail while the held one runs",
            )
            assert value(held, "flywheel_reward_hook_runs_total", source="hook:broken", outcome="failed") == 1
            gate.touch()
            done = await _scrape_until(
                url, lambda s: value(s, "flywheel_reward_hook_runs_total", source="hook:held", outcome="done")
                and value(s, "flywheel_reward_hook_jobs_in_flight") == 0, "the held job to finish",
            )
        assert value(done, "flywheel_reward_hook_seconds_count", source="hook:held") == 1
        assert value(done, "flywheel_reward_hook_failures_total", source="hook:held") is None
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
