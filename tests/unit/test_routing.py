"""proxy/workers/routing.py without servers: the balancer's ordering of workers (sticky sessions, slack,
least busy, down workers last) and its session map."""

from __future__ import annotations

from typing import Any

from proxy.metrics import ProxyMetrics
from proxy.workers.routing import Balancer, RoutingPolicy
from serving.client import SGLangClient
from serving.config import ClientConfig


def balancer(n: int = 3, health_checks: bool = False, **policy: Any) -> Balancer:
    clients = [SGLangClient(f"http://w{i}", ClientConfig()) for i in range(n)]
    b = Balancer(clients, ProxyMetrics(), failure_cooldown_s=60, policy=RoutingPolicy(**policy))
    b.health_checking = health_checks
    return b


def pick(b: Balancer, session: str | None) -> str:
    worker = b.candidates(session)[0]
    with b.lease(worker, session):
        return worker.url


def test_sessions_stick_and_new_sessions_take_turns() -> None:
    b = balancer()
    assert [pick(b, f"s{i}") for i in range(3)] == ["http://w0", "http://w1", "http://w2"]
    assert [pick(b, "s1") for _ in range(3)] == ["http://w1"] * 3  # round-robin would move it
    assert pick(b, "s3") == "http://w0"  # least recently used among the idle


def test_a_busy_sticky_worker_is_left_beyond_the_slack() -> None:
    b = balancer(n=2, sticky_slack=1)
    assert pick(b, "s") == "http://w0"
    home = b.workers[0]
    b.acquire(home)
    assert b.candidates("s")[0] is home  # one more in flight: within the slack
    b.acquire(home)
    assert b.candidates("s")[0] is b.workers[1]  # two more: moves
    b.release(home)
    b.release(home)
    assert b.candidates("s")[0] is home


def test_down_workers_come_last_and_sessions_leave_them() -> None:
    b = balancer(n=2, health_checks=True)
    assert pick(b, "s") == "http://w0"
    b.mark_failed(b.workers[0], "connect")
    assert [w.url for w in b.candidates("s")] == ["http://w1", "http://w0"]
    assert [w.url for w in b.candidates(None)] == ["http://w1", "http://w0"]
    b.mark_ok(b.workers[0])
    assert b.candidates("s")[0] is b.workers[0]


def test_without_health_checks_a_failed_worker_returns_after_the_cooldown() -> None:
    b = balancer(n=2)
    b.mark_failed(b.workers[0], "connect")
    assert b.candidates()[-1] is b.workers[0]
    b.workers[0].failed_until = 0.0  # the cooldown is over
    assert b.candidates()[0] is b.workers[0] and b.workers[0].up


def test_the_session_map_forgets_the_least_recently_used() -> None:
    b = balancer(n=2, sticky_sessions_max=2)
    for session in ("a", "b", "c"):
        pick(b, session)
    assert b.sticky_worker("a") is None and b.sticky_worker("c") is not None


def test_balancer_prefers_idle_healthy_workers_in_turn() -> None:
    clients = [SGLangClient(f"http://w{i}", ClientConfig()) for i in range(3)]
    balancer = Balancer(clients, ProxyMetrics(), failure_cooldown_s=60)
    picks = []
    for _ in range(6):
        worker = balancer.candidates()[0]
        with balancer.lease(worker):
            picks.append(worker.url)
    assert picks == ["http://w0", "http://w1", "http://w2"] * 2
    busy = balancer.workers[0]
    balancer.acquire(busy)
    assert balancer.candidates()[-1] is busy
    balancer.release(busy)
    balancer.mark_failed(balancer.workers[1], "connect")
    assert balancer.candidates()[-1] is balancer.workers[1]
