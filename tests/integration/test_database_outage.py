"""The proxy rides out a database outage: Postgres (a server of the test's own) is stopped under load and
started again. Meanwhile new work gets 503 with Retry-After (never a 500), calls already running wait for
their record, and afterwards every answer a client saw complete, JSON or streamed, is in the database."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from storage.migrate import upgrade
from tests.support.databases import REQUIRE_POSTGRES_ENV, run_outside_loop
from tests.support.postgres_cluster import PostgresCluster, postgres_bin_dir
from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker

CLIENTS = 4


@pytest.fixture
def cluster() -> Iterator[PostgresCluster]:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail("no Postgres binaries (initdb, pg_ctl) to start a server of the test's own")
        pytest.skip("no Postgres binaries (initdb, pg_ctl) to start a server of the test's own")
    server = PostgresCluster(bin_dir)
    server.start()
    run_outside_loop(upgrade, server.url())
    yield server
    server.destroy()


@dataclass
class Outcomes:
    """What the clients saw."""

    completed: list[str] = field(default_factory=list)
    """Ids of answers that completed: a JSON 200, or a stream that reached `data: [DONE]`."""
    refused: list[httpx.Response] = field(default_factory=list)
    """503s (their Retry-After is checked)."""
    cut: int = 0
    """Streams that ended with an error event instead of [DONE]."""
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _call(
    client: httpx.Client, proxy: Proxy, stream: bool, outcomes: Outcomes, key: str | None = None
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
    headers = {"Authorization": f"Bearer {key or proxy.session_key}"}
    with client.stream("POST", f"{proxy.v1}/chat/completions", json=body, headers=headers) as answer:
        if answer.status_code == 503:
            answer.read()
            with outcomes.lock:
                outcomes.refused.append(answer)
            return
        if answer.status_code != 200:
            with outcomes.lock:
                outcomes.unexpected.append(f"{answer.status_code}: {answer.read()[:200]!r}")
            return
        if not stream:
            completion_id = json.loads(answer.read())["id"]
        else:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
            if events[-1] != "[DONE]":
                assert "error" in json.loads(events[-1])
                with outcomes.lock:
                    outcomes.cut += 1
                return
            completion_id = json.loads(events[0])["id"]
    with outcomes.lock:
        outcomes.completed.append(completion_id)


def _load(proxy: Proxy, stop: threading.Event, outcomes: Outcomes, stream: bool) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            _call(client, proxy, stream, outcomes)


@pytest.fixture
def proxy(cluster: PostgresCluster, tiny_model_dir: Path, scripted: ScriptedWorker) -> Iterator[Proxy]:
    """A proxy on the test's own Postgres, quick to notice the database and to retry it."""
    factory = ProxyFactory(cluster.url(), tiny_model_dir)
    with factory.stack:
        yield factory.start([scripted.url], database_retry_after_s=1.0, database_probe_interval_s=0.2,
                            record_retry_s=60.0, rate_limits={"session": {}})  # the load is no runaway


def test_a_database_outage_refuses_new_work_with_503_and_loses_no_answer(
    cluster: PostgresCluster, proxy: Proxy
) -> None:
    _session, other_key = proxy.new_session_key()
    outcomes = Outcomes()
    stop = threading.Event()
    clients = [threading.Thread(target=_load, args=(proxy, stop, outcomes, stream))
               for stream in [False, True] * (CLIENTS // 2)]
    for client in clients:
        client.start()
    time.sleep(1.0)
    before = len(outcomes.completed)
    cluster.stop()
    time.sleep(0.5)  # the clients' calls meet the outage: the circuit opens
    probes = Outcomes()
    with httpx.Client(timeout=30) as client:
        for key in (proxy.session_key, other_key):  # a cached key, and one the proxy must look up
            _call(client, proxy, False, probes, key)
    time.sleep(2.5)
    cluster.start()
    time.sleep(2.0)
    stop.set()
    for client in clients:
        client.join(120)

    assert not outcomes.unexpected, outcomes.unexpected[:5]
    assert before > 0 and len(outcomes.completed) > before  # served before, and again after
    assert len(probes.refused) == 2, "new calls were not refused while the database was down"
    refused = outcomes.refused + probes.refused
    assert all(int(answer.headers["retry-after"]) >= 1 for answer in refused)
    assert {answer.json()["error"]["code"] for answer in refused} == {"database_unavailable"}
    recorded = {row.id for row in proxy.completions()}
    missing = set(outcomes.completed) - recorded
    assert not missing, f"{len(missing)} answers the clients saw complete are not recorded"
