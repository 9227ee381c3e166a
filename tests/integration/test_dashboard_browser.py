"""The dashboard in a real browser: headless Chromium (Debian's, driven by Playwright) opens `/dashboard` of
a proxy in front of the CPU engine with the tiny model, after a few rewarded sessions went through it,
signs in with the admin key, sees the reward curve drawn with a point per session, opens a session and
its tokens (each coloured by its logprob, with its policy version), and leaves a screenshot (in the test's
tmp_path, and in $FLYWHEEL_TEST_ARTIFACTS when set). Skips, saying why, without chromium or playwright,
unless FLYWHEEL_TEST_REQUIRE_BROWSER=1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from storage.migrate import upgrade
from tests.support.dashboard import chromium_or_skip, headless_page, save_screenshot
from tests.support.databases import run_outside_loop
from tests.support.engine_server import running_engine
from tests.support.proxy_harness import Proxy, ProxyFactory

REWARDS = (0.25, 0.5, 1.0)
TIMEOUT_MS = 15_000


@pytest.fixture
def chromium() -> str:
    """Debian's chromium, checked before anything starts (a skip costs nothing)."""
    return chromium_or_skip()


@pytest.fixture
def served(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Proxy]:
    """A proxy on a fresh SQLite database in front of one CPU engine serving the tiny model."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    run_outside_loop(upgrade, url)
    factory = ProxyFactory(url, tiny_model_dir)
    with running_engine(tiny_model_dir) as engine_url, factory.stack:
        yield factory.start([engine_url])


def rewarded_sessions(proxy: Proxy) -> dict[str, int]:
    """Sessions of run "demo", each one chat call then a reward, ended: their ids and how many tokens
    their call generated."""
    admin = httpx.Client(base_url=proxy.base_url, headers={"Authorization": f"Bearer {proxy.admin_key}"},
                         timeout=60)
    generated = {}
    with admin:
        for i, reward in enumerate(REWARDS):
            body = {"task": {"id": f"q{i}"}, "metadata": {"run": "demo"}}
            created = admin.post("/rl/v1/sessions", json=body)
            assert created.status_code == 201, created.text
            session_id, key = created.json()["session_id"], created.json()["api_key"]
            answer = proxy.client(key).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"count to {i + 3}"}], max_tokens=8)
            assert answer.usage is not None
            for path, body in ((f"/rl/v1/sessions/{session_id}/reward", {"value": reward}),
                               (f"/rl/v1/sessions/{session_id}/end", None)):
                done = admin.post(path, json=body)
                assert done.status_code == 200, done.text
            generated[session_id] = answer.usage.completion_tokens
    return generated


def test_the_dashboard_draws_rewards_and_a_sessions_tokens(
    chromium: str, served: Proxy, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    generated = rewarded_sessions(served)
    opened = next(sid for sid, count in generated.items() if count > 0)  # the tiny model may stop at once
    problems: list[str] = []
    with headless_page(chromium) as page:
        page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
        page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"{served.base_url}/dashboard")
        for key in ("fw-admin-wrong", served.session_key):  # refused: no data, the sign-in form stays
            page.fill("#key-input", key)
            page.click("#login-form button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("Refused")
            assert page.locator("#main").is_hidden()
        problems.clear()  # the browser logs the refusals' 401 and 403; from here on, nothing may fail
        page.fill("#key-input", served.admin_key)
        page.click("#login-form button[type=submit]")

        points = page.locator("#reward-chart circle.point")  # the panels load side by side: wait for each
        points.nth(len(REWARDS) - 1).wait_for()
        assert points.count() == len(REWARDS)
        expect(page.locator("#reward-legend")).to_contain_text("demo: 3 sessions")
        expect(page.locator("#summary")).to_contain_text("sessions open")
        expect(page.locator("#staleness-note")).to_contain_text("waiting samples against v0")

        page.locator(f'#sessions-table tbody tr[data-session="{opened}"]').click()
        tokens = page.locator("#detail-tree .token")
        tokens.first.wait_for()
        assert page.locator("#detail-id").inner_text() == opened
        shown = tokens.evaluate_all(
            "spans => spans.map(s => [s.dataset.version, s.dataset.logprob, s.style.backgroundColor])")
        assert len(shown) == generated[opened]
        assert all(version == "0" for version, _, _ in shown)  # the initial weights generated them all
        assert all(logprob and float(logprob) <= 0 for _, logprob, _ in shown)
        assert all(colour.startswith("rgb(") for _, _, colour in shown)
        assert page.locator("#detail-tree .version-mark").first.inner_text() == "v0"
        assert page.locator("#detail-rewards tbody tr").count() == 1

        screenshot = save_screenshot(page, tmp_path, "dashboard.png")
    assert screenshot.stat().st_size > 10_000
    assert problems == []
