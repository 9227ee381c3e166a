"""The proxy's view of whether its database answers: a circuit breaker in front of new work.

A failure that says the database is unreachable (storage/errors.py `is_unavailable`: a refused or lost
connection, a server shutting down) opens the circuit. While it is open, new calls are refused at once
with 503 and `Retry-After` (the openai client waits and retries) instead of each waiting out its own
connection attempt, and one probe asks the database `SELECT 1` every `probe_interval_s`; its first
answer closes the circuit. Work already under way is not refused: the recorder keeps retrying its
writes while the database is down (proxy/recording/recorder.py), so an answer is released only once
it is recorded. docs/reliability.md states the guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.errors import unavailable_error
from proxy.metrics import ProxyMetrics
from storage.errors import is_unavailable

logger = logging.getLogger(__name__)


class DatabaseCircuit:
    """Open while the database is unreachable (see the module docstring)."""

    def __init__(
        self, engine: AsyncEngine, metrics: ProxyMetrics, retry_after_s: float, probe_interval_s: float
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self.retry_after_s = retry_after_s
        self._probe_interval_s = probe_interval_s
        self._probe: asyncio.Task[None] | None = None
        metrics.database_up.set(1)

    @property
    def is_open(self) -> bool:
        return self._probe is not None

    def check(self) -> None:
        """Refuse new work (503, Retry-After) while the circuit is open."""
        if self._probe is not None:
            raise unavailable_error(self.retry_after_s)

    def failed(self, exc: BaseException) -> bool:
        """Note a failure: an unavailable database opens the circuit. Whether it did (or was open)."""
        if not is_unavailable(exc):
            return False
        if self._probe is None:
            logger.warning("database unavailable (%s: %s); refusing new work until it answers",
                           type(exc).__name__, exc)
            self._metrics.database_up.set(0)
            self._probe = asyncio.create_task(self._run_probe(), name="database-probe")
        return True

    async def _run_probe(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                async with self._engine.connect() as connection:
                    await connection.execute(text("SELECT 1"))
            except Exception as exc:  # a probe's failure is the expected answer while the outage lasts
                logger.debug("database probe failed: %s", exc)
                continue
            logger.warning("database answers again; accepting new work")
            self._metrics.database_up.set(1)
            self._probe = None
            return

    async def stop(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
