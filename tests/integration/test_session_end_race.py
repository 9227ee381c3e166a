"""Ending a session while one of its calls is generating loses nothing: AReaL's `/rl/end_session`
finalizes at once, yet the session's trajectories include the call that was in flight (answered 200),
and a call that starts after the end is refused. On SQLite and Postgres."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from storage.models import SessionStatus
from tests.support.finalizing import session_trajectories
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory, run_db, session_completions
from tests.support.scripted_worker import ScriptedWorker

TOKENS = 24


@pytest.fixture
def slow_worker(servers: LoopThread) -> Iterator[ScriptedWorker]:
    """A worker that takes about a second to write TOKENS tokens."""
    worker = servers.start_scripted(token_delay_s=0.04)
    yield worker
    servers.call(worker.stop())


def _wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:  # the test thread reads it
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _session_status(proxy: Proxy) -> str:
    [session] = [s for s in proxy.sessions() if s.id == proxy.session_id]
    return session.status


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_in_flight_call_lands_in_the_trajectory_of_a_session_ended_meanwhile(
    proxies: ProxyFactory, slow_worker: ScriptedWorker, stream: bool
) -> None:
    proxy = proxies.start([slow_worker.url])
    client = proxy.client()
    messages = [{"role": "user", "content": "a long answer, please"}]

    def call() -> str:
        if not stream:
            answer = client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS)
            return answer.id
        chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=TOKENS,
                                                     stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        return chunks[0].id

    thread, out = _in_background(call)
    _wait_for(lambda: slow_worker.in_flight == 1)
    ended = httpx.post(f"{proxy.base_url}/rl/end_session", json={},
                       headers={"Authorization": f"Bearer {proxy.session_key}"}, timeout=30)
    assert ended.status_code == 200
    late = httpx.post(f"{proxy.v1}/chat/completions", json={"model": "m", "messages": messages},
                      headers={"Authorization": f"Bearer {proxy.session_key}"}, timeout=30)
    assert late.status_code == 401  # the session no longer takes calls
    thread.join(30)
    assert "error" not in out, out.get("error")
    completion_id = out["result"]

    _wait_for(lambda: _session_status(proxy) == SessionStatus.FINALIZED.value)
    [recorded] = session_completions(proxy)
    assert recorded.id == completion_id and len(recorded.output_ids) == TOKENS
    [trajectory] = run_db(proxy.db_url, lambda factory: session_trajectories(factory, proxy.session_id))
    assert int(sum(trajectory.loss_mask)) == TOKENS  # the in-flight call's tokens are trained
