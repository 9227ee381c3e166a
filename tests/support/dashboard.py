"""Helpers of the dashboard's tests: the operated run (tests/support/operated_run.py) with a reward on every
session that has one in its table, a proxy on it whose reward hooks do not run (so nothing changes while
the tests read), an admin client of its JSON API, and the headless Chromium the browser test drives."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewards.config import HookRunnerConfig, RewardsConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import Reward
from storage.queries import add_reward
from tests.support.databases import run_coroutine_outside_loop, storage_config
from tests.support.operated_run import OperatedRun, record_operated_run
from tests.support.proxy_harness import Proxy, ProxyFactory

CHROMIUM = "/usr/bin/chromium"
REQUIRE_BROWSER_ENV = "FLYWHEEL_TEST_REQUIRE_BROWSER"
ARTIFACTS_ENV = "FLYWHEEL_TEST_ARTIFACTS"

REWARDS = {"a-1": 1.0, "a-2": 0.0, "b-1": 0.75, "b-2": -1.0, "b-3": 2.0, "a-3": 0.5}
"""Each rewarded session's combined reward once `record_dashboard_run` has run (rest wins over hooks)."""

NO_HOOK_RUNNER = RewardsConfig(runner=HookRunnerConfig(in_proxy=False))
"""A proxy that leaves a-4's queued hook job queued."""


async def record_dashboard_run(session_factory: SessionFactory) -> OperatedRun:
    """The operated run, plus rewards: a client's on a-1, a-2, b-2 and b-3 (b-3 also a hook's 0.5, which
    the client's outweighs), written as rows since those sessions are finalized already, and one on
    active a-3's completion through storage's own write."""
    run = await record_operated_run(session_factory)
    async with session_factory() as db, db.begin():
        for session_id in ("a-1", "a-2", "b-2", "b-3"):
            db.add(Reward(session_id=session_id, value=REWARDS[session_id], source="rest", details={}))
        db.add(Reward(session_id="b-3", value=0.5, source="hook:math", details={}))
    await add_reward(session_factory, REWARDS["a-3"], completion_id="a-3-c")
    return run


def record_dashboard_run_at(db_url: str) -> OperatedRun:
    """`record_dashboard_run` on the (migrated) database at `db_url`, from sync code."""

    async def record() -> OperatedRun:
        engine = create_engine(storage_config(db_url))
        try:
            return await record_dashboard_run(create_sessionmaker(engine))
        finally:
            await engine.dispose()

    return run_coroutine_outside_loop(record)


def dashboard_proxy(factory: ProxyFactory) -> Proxy:
    """A proxy on the factory's database, in front of no live worker (the dashboard never generates)."""
    return factory.start(["http://127.0.0.1:9"], rewards=NO_HOOK_RUNNER)


@dataclass
class DashboardApi:
    """GETs of `/dashboard/api/…` with a key."""

    base_url: str
    key: str | None

    def get(self, path: str, **params: Any) -> httpx.Response:
        headers = {} if self.key is None else {"Authorization": f"Bearer {self.key}"}
        return httpx.get(f"{self.base_url}/dashboard/api/{path}", params=params, headers=headers, timeout=30)

    def json(self, path: str, **params: Any) -> Any:
        answer = self.get(path, **params)
        assert answer.status_code == 200, answer.text
        return answer.json()


def all_sessions(api: DashboardApi, **filters: Any) -> list[str]:
    """Every session the table lists with `filters`, following `next_cursor` page by page."""
    ids: list[str] = []
    cursor = None
    for _ in range(100):
        page = api.json("sessions", **filters, **({} if cursor is None else {"cursor": cursor}))
        ids += [s["session_id"] for s in page["sessions"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids
    raise AssertionError("the sessions table never ended")


def chromium_or_skip() -> str:
    """Debian's chromium for Playwright; a skip naming what is missing, or a failure when
    FLYWHEEL_TEST_REQUIRE_BROWSER=1 (CI installs both)."""
    missing = []
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        missing.append(f"chromium ({CHROMIUM}; apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install playwright, the dev extra)")
    if missing:
        reason = "the dashboard's browser test needs " + " and ".join(missing)
        if os.environ.get(REQUIRE_BROWSER_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))


@contextmanager
def headless_page(executable: str) -> Iterator[Any]:
    """A Playwright page in a fresh headless Chromium (never a downloaded browser)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        flags = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=flags)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            yield page
        finally:
            browser.close()


def save_screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot in `tmp_path`, copied into $FLYWHEEL_TEST_ARTIFACTS when that is set."""
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    artifacts = os.environ.get(ARTIFACTS_ENV)
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / name)
    return path
