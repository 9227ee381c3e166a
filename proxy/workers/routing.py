"""Which worker serves a request: sticky by session (a session's calls go back to the worker that has its
prefix cached), least requests in flight for new sessions, round-robin among ties, and workers that
failed (a refused or dropped connection, a 5xx, a failed `GET /health`) out of rotation until they pass
a health check again.

Down workers are still listed, last: when every worker is down the request is tried anyway (a paused
SGLang may fail health checks yet queue requests), and a refused connection answers 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from proxy.metrics import ProxyMetrics
from serving.client import SGLangClient

logger = logging.getLogger(__name__)

Decode = Callable[[Sequence[int]], str]


@dataclass(eq=False, slots=True)
class Worker:
    """One worker as the balancer sees it."""

    client: SGLangClient
    in_flight: int = 0
    failed_until: float = 0.0
    """Without health checks, a failed worker comes back into rotation at this monotonic time."""
    up: bool = True
    """In rotation. A failure takes it out; a passed health check (or a successful call) puts it back."""
    last_used: int = 0

    @property
    def url(self) -> str:
        return self.client.base_url


@dataclass(slots=True)
class RoutingPolicy:
    """The knobs of routing and resumption (ProxyConfig's, given when the balancer is built)."""

    sticky_slack: int = 4
    """A session stays on its worker unless that one runs this many more requests than the least busy."""
    sticky_sessions_max: int = 100_000
    """Sessions remembered (least recently used forgotten first)."""
    resume_max_attempts: int = 20
    """Most re-issues of one choice after aborts (weight pushes) and lost workers."""
    resume_timeout_s: float = 600.0
    """Longest time spent re-issuing one choice before it is recorded as aborted."""


class Balancer:
    """Orders workers for each request and counts what each one is running."""

    def __init__(
        self, clients: Sequence[SGLangClient], metrics: ProxyMetrics, failure_cooldown_s: float,
        policy: RoutingPolicy | None = None, decode: Decode | None = None,
    ) -> None:
        if not clients:
            raise ValueError("the proxy needs at least one worker")
        self.workers = [Worker(client) for client in clients]
        self.policy = policy or RoutingPolicy()
        self.decode = decode
        """The tokenizer's decode (skip special tokens), to rejoin text a resumed generation split
        inside a UTF-8 character."""
        self.health_checking = False
        """True while a health-check task runs: failed workers then wait for it instead of a cooldown."""
        self._metrics = metrics
        self._cooldown_s = failure_cooldown_s
        self._uses = 0
        self._sessions: OrderedDict[str, Worker] = OrderedDict()
        for worker in self.workers:
            metrics.worker_up.labels(worker.url).set(1)

    def in_rotation(self, worker: Worker) -> bool:
        if worker.up:
            return True
        if not self.health_checking and worker.failed_until <= time.monotonic():
            self._set_up(worker, True)  # no health checks: the cooldown is over
            return True
        return False

    def candidates(self, session_id: str | None = None) -> list[Worker]:
        """Every worker, best first: in rotation before down, then fewest in flight; ties go to the least
        recently used, so equal workers take turns (round-robin). A session's last worker comes first
        while it is up and at most `sticky_slack` requests busier than the least busy worker."""
        ranked = sorted(self.workers, key=lambda w: (not self.in_rotation(w), w.in_flight, w.last_used))
        if session_id is None:
            return ranked
        sticky = self._sessions.get(session_id)
        if sticky is None:
            self._metrics.sticky_routing.labels("new").inc()
            return ranked
        if sticky.up and sticky.in_flight - ranked[0].in_flight <= self.policy.sticky_slack:
            self._metrics.sticky_routing.labels("hit").inc()
            return [sticky, *(w for w in ranked if w is not sticky)]
        self._metrics.sticky_routing.labels("miss").inc()
        return ranked

    def acquire(self, worker: Worker, session_id: str | None = None) -> None:
        """Count one more request running on `worker` (until `release`); the session sticks to it."""
        worker.in_flight += 1
        self._uses += 1
        worker.last_used = self._uses
        self._metrics.worker_in_flight.labels(worker.url).set(worker.in_flight)
        if session_id is not None:
            self._sessions[session_id] = worker
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self.policy.sticky_sessions_max:
                self._sessions.popitem(last=False)

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self._metrics.worker_in_flight.labels(worker.url).set(worker.in_flight)

    @contextmanager
    def lease(self, worker: Worker, session_id: str | None = None) -> Iterator[Worker]:
        """Count a request on `worker` while the block runs."""
        self.acquire(worker, session_id)
        try:
            yield worker
        finally:
            self.release(worker)

    def sticky_worker(self, session_id: str) -> Worker | None:
        """The worker `session_id` sticks to, if any."""
        return self._sessions.get(session_id)

    def count_resume(self, cause: str) -> None:
        """A generation was re-issued as prompt + tokens so far (`abort` or `lost`)."""
        self._metrics.resumes.labels(cause).inc()

    def mark_failed(self, worker: Worker, kind: str) -> None:
        """A call to `worker` failed: out of rotation until a health check passes (or, without health
        checks, for the failure cooldown)."""
        worker.failed_until = time.monotonic() + self._cooldown_s
        self._set_up(worker, False)
        self._metrics.worker_errors.labels(worker.url, kind).inc()

    def mark_ok(self, worker: Worker) -> None:
        worker.failed_until = 0.0
        self._set_up(worker, True)

    def _set_up(self, worker: Worker, up: bool) -> None:
        if worker.up != up:
            logger.warning("worker %s is %s", worker.url, "back in rotation" if up else "out of rotation")
        worker.up = up
        self._metrics.worker_up.labels(worker.url).set(1 if up else 0)

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """`GET /health` on every worker at once; each result takes the worker out of rotation or puts
        it back (no answer within `timeout_s` is a failure)."""
        probes = (asyncio.wait_for(w.client.health(), timeout_s) for w in self.workers)
        results = await asyncio.gather(*probes, return_exceptions=True)
        for worker, result in zip(self.workers, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            healthy = result is True
            if not healthy and worker.up:
                self._metrics.worker_errors.labels(worker.url, "health").inc()
            if healthy:
                worker.failed_until = 0.0
            self._set_up(worker, healthy)


@asynccontextmanager
async def health_checks(balancer: Balancer, interval_s: float) -> AsyncIterator[None]:
    """Poll every worker's `/health` each `interval_s` while the block runs (nothing when 0)."""
    if interval_s <= 0:
        yield
        return

    async def poll() -> None:
        while True:
            try:
                await balancer.check_health(timeout_s=max(interval_s * 2, 1.0))
            except Exception:  # a task boundary: keep polling whatever one round did
                logger.exception("health check round failed")
            await asyncio.sleep(interval_s)

    balancer.health_checking = True
    task = asyncio.create_task(poll(), name="worker-health-checks")
    try:
        yield
    finally:
        balancer.health_checking = False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
