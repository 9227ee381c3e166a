"""Simple worker balancing: least requests in flight, round-robin among ties, recently failed workers
last. (Sticky routing per session comes later.)"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from proxy.metrics import ProxyMetrics
from serving.client import SGLangClient


@dataclass(eq=False, slots=True)
class Worker:
    """One worker as the balancer sees it."""

    client: SGLangClient
    in_flight: int = 0
    failed_until: float = 0.0
    last_used: int = 0

    @property
    def url(self) -> str:
        return self.client.base_url


class Balancer:
    """Orders workers for each request and counts what each one is running."""

    def __init__(
        self, clients: Sequence[SGLangClient], metrics: ProxyMetrics, failure_cooldown_s: float
    ) -> None:
        if not clients:
            raise ValueError("the proxy needs at least one worker")
        self.workers = [Worker(client) for client in clients]
        self._metrics = metrics
        self._cooldown_s = failure_cooldown_s
        self._uses = 0

    def candidates(self) -> list[Worker]:
        """Every worker, best first: healthy before recently failed, then fewest in flight; ties go to
        the least recently used, so equal workers take turns (round-robin)."""
        now = time.monotonic()
        return sorted(self.workers, key=lambda w: (w.failed_until > now, w.in_flight, w.last_used))

    def acquire(self, worker: Worker) -> None:
        """Count one more request running on `worker` (until `release`)."""
        worker.in_flight += 1
        self._uses += 1
        worker.last_used = self._uses
        self._metrics.worker_in_flight.labels(worker.url).set(worker.in_flight)

    def release(self, worker: Worker) -> None:
        worker.in_flight -= 1
        self._metrics.worker_in_flight.labels(worker.url).set(worker.in_flight)

    @contextmanager
    def lease(self, worker: Worker) -> Iterator[Worker]:
        """Count a request on `worker` while the block runs."""
        self.acquire(worker)
        try:
            yield worker
        finally:
            self.release(worker)

    def mark_failed(self, worker: Worker, kind: str) -> None:
        """A connection to `worker` failed: try it last for a while."""
        worker.failed_until = time.monotonic() + self._cooldown_s
        self._metrics.worker_errors.labels(worker.url, kind).inc()

    def mark_ok(self, worker: Worker) -> None:
        worker.failed_until = 0.0
