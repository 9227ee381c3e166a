"""The proxy's and the engine's /metrics after real traffic (the `openai` client through the proxy to the CPU
engine serving the tiny model), parsed as Prometheus parses them: requests and their latency by route and
status, 429s of a rate limit and of admission control among them, a request in flight while the engine
holds it, the served policy version, the recorder's queue, the in-proxy hook runner's jobs, and the
engine's decode counters, each present and moving."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.engine_server import running_engine
from tests.support.metrics_readers import Samples, scrape, total, value
from tests.support.proxy_harness import ProxyFactory

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Count to three."}]


@pytest.fixture
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with running_engine(tiny_model_dir) as url:
        yield url


def scrape_until(url: str, ready: Callable[[Samples], object], what: str) -> Samples:
    deadline = time.monotonic() + 30
    while not ready(samples := scrape(url)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return samples


def post(base_url: str, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # metrics are not about the database
def test_proxy_and_engine_series_move_with_traffic(proxies: ProxyFactory, engine_url: str) -> None:
    proxy = proxies.start(
        [engine_url], rate_limits={"session": {"requests_per_s": 0.01, "burst": 1}},
        admission={"enabled": True, "batch_size": 1, "max_head_offpolicyness": 0},
    )
    metrics = f"{proxy.base_url}/metrics"
    before, engine_before = scrape(metrics), scrape(f"{engine_url}/metrics")
    assert value(before, "flywheel_proxy_policy_version") is None  # nothing served yet
    assert value(before, "flywheel_proxy_record_queue") == 0
    assert value(before, "flywheel_reward_hook_jobs_in_flight") == 0  # the proxy runs the hooks
    assert total(before, "flywheel_proxy_requests_total", route=CHAT) == 0

    # A call the paused engine holds is in flight on its route until the engine goes on.
    assert httpx.post(f"{engine_url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    answers: list[httpx.Response] = []
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6}
    held = threading.Thread(target=lambda: answers.append(post(proxy.base_url, CHAT, proxy.admin_key, body)))
    held.start()
    during = scrape_until(metrics, lambda s: value(s, "flywheel_proxy_requests_in_flight", route=CHAT) == 1,
                          "the held call in flight")
    assert httpx.post(f"{engine_url}/continue_generation", json={}).status_code == 200
    held.join(60)
    assert [a.status_code for a in answers] == [200]
    assert value(during, "flywheel_proxy_requests_in_flight", route="/metrics") == 1  # the scrape itself

    # A stream, then the same session key over its rate; then admission's 429 on the RL API.
    stream = proxy.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                    stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert post(proxy.base_url, CHAT, proxy.session_key, body).status_code == 429
    created = [post(proxy.base_url, "/rl/v1/sessions", proxy.admin_key, {"task": "t"}) for _ in range(2)]
    assert [c.status_code for c in created] == [201, 429]

    after = scrape_until(metrics, lambda s: value(s, "flywheel_proxy_requests_in_flight", route=CHAT) == 0,
                         "no chat call in flight")
    assert value(after, "flywheel_proxy_requests_total", route=CHAT, status="200") == 2
    assert value(after, "flywheel_proxy_requests_total", route=CHAT, status="429") == 1
    assert value(after, "flywheel_proxy_requests_total", route="/rl/v1/sessions", status="429") == 1
    assert value(after, "flywheel_proxy_request_seconds_count", route=CHAT, status="200") == 2
    assert value(after, "flywheel_proxy_request_seconds_count", route=CHAT, status="429") == 1
    assert value(after, "flywheel_proxy_request_seconds_bucket", route=CHAT, status="200", le="+Inf") == 2
    assert value(after, "flywheel_proxy_policy_version") == 0  # the engine serves the initial weights
    assert value(after, "flywheel_proxy_record_queue") == 0
    assert value(after, "flywheel_proxy_time_to_first_token_seconds_count") == 1
    assert total(after, "flywheel_proxy_tokens_total", kind="completion") > 0
    assert total(after, "flywheel_proxy_completions_total") == 2
    assert value(after, "flywheel_proxy_admission_refused_total", kind="session") == 1

    engine_after = scrape(f"{engine_url}/metrics")
    for series in ("flywheel_engine_decode_steps_total", "flywheel_engine_generated_tokens_total",
                   "flywheel_engine_prefills_total"):
        assert value(engine_before, series) == 0 and (value(engine_after, series) or 0) > 0, series
    assert total(engine_after, "flywheel_engine_finished_requests_total") == 2
    assert value(engine_after, "flywheel_engine_running_requests") == 0
