"""The completion recorder: group commit of concurrent writes.

Callers `await recorder.record(records)`; one background task drains the queue and writes everything
waiting (up to `batch_max` completions) in one transaction, then resolves each caller's future. While
one transaction runs, the next batch gathers, so throughput grows with concurrency instead of paying
one commit per request. Each transaction is written the cheapest way its database allows
(storage/writer.py: one thread hop per transaction on SQLite). If a batch fails, its entries are
retried one by one, so one bad entry fails only its own caller. A caller gets the exception of its
own failed write.

A database that is down (storage/errors.py `is_unavailable`) is waited out: the batch is written again,
backing off, for up to `retry_s`, while `on_unavailable` tells the proxy to refuse new work; callers
wait meanwhile, so no answer is released before it is recorded. A write whose connection was lost after
the server committed it is found on the retry (its ids exist) and counts as written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import select

from proxy.metrics import ProxyMetrics
from storage.engine import SessionFactory
from storage.errors import is_duplicate, is_unavailable
from storage.models import Completion
from storage.records import CompletionRecord
from storage.writer import completion_writer

logger = logging.getLogger(__name__)


_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 2.0


class RecorderClosed(RuntimeError):
    """The recorder was stopped; nothing more can be written through it."""


@dataclass(slots=True)
class _Pending:
    records: Sequence[CompletionRecord]
    done: asyncio.Future[None]


class Recorder:
    """Batches completion writes; `start()` inside the running loop, `stop()` drains and ends it."""

    def __init__(
        self, session_factory: SessionFactory, batch_max: int, metrics: ProxyMetrics, retry_s: float = 0.0,
        on_unavailable: Callable[[BaseException], object] | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._writer = completion_writer(session_factory)
        self._batch_max = batch_max
        self._metrics = metrics
        self._retry_s = retry_s
        self._on_unavailable = on_unavailable
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._writing = 0  # calls in the transaction under way

    @property
    def backlog(self) -> int:
        """Calls waiting for their completions to be written: queued, or in the transaction under way."""
        return self._queue.qsize() + self._writing

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="flywheel-recorder")

    async def stop(self) -> None:
        """Write everything already queued, then end the background task."""
        self._closed = True
        if self._task is None:
            return
        self._queue.put_nowait(None)
        await self._task
        self._task = None
        await self._writer.close()

    async def record(self, records: Sequence[CompletionRecord]) -> None:
        """Write `records` in one transaction (with whatever else is waiting); returns once committed."""
        if self._closed or self._task is None or self._task.done():
            raise RecorderClosed("the completion recorder is not running")
        if not records:
            return
        pending = _Pending(records, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(pending)
        await pending.done

    async def _run(self) -> None:
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is None:
                break
            batch = [first]
            count = len(first.records)
            while count < self._batch_max and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is None:
                    stopping = True
                    break
                batch.append(item)
                count += len(item.records)
            self._writing = len(batch)
            await self._write(batch)
            self._writing = 0
        # Anything queued after the stop marker (a race with stop()) still gets an answer.
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                await self._write([item])

    async def _write(self, batch: list[_Pending]) -> None:
        records = [record for pending in batch for record in pending.records]
        started = time.perf_counter()
        try:
            try:
                await self._writer.write(records)
            except Exception as first:
                await self._write_through_outage(records, first)
        except Exception as exc:
            if len(batch) == 1 or is_unavailable(exc):
                for pending in batch:
                    self._fail(pending, exc)
                return
            logger.warning("group commit of %d completions failed (%s); writing them one by one",
                           len(records), exc)
            for pending in batch:
                await self._write([pending])
            return
        self._metrics.record_seconds.observe(time.perf_counter() - started)
        self._metrics.record_batch_size.observe(len(records))
        for pending in batch:
            if not pending.done.done():
                pending.done.set_result(None)

    async def _write_through_outage(self, records: list[CompletionRecord], first: Exception) -> None:
        """After writing `records` failed with `first`: while the database is unavailable, write them again
        and again for up to `retry_s`; any other error is raised."""
        deadline: float | None = None
        delay = _FIRST_BACKOFF_S
        exc = first
        while True:
            # After a lost connection the server may have committed the write: then it is done.
            if deadline is not None and is_duplicate(exc) and await self._all_written(records):
                return
            now = time.monotonic()
            deadline = deadline if deadline is not None else now + self._retry_s
            if not is_unavailable(exc) or now >= deadline:
                raise exc
            if self._on_unavailable is not None:
                self._on_unavailable(exc)
            logger.warning("recording %d completion(s) waits for the database: %s", len(records), exc)
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _MAX_BACKOFF_S)
            try:
                await self._writer.write(records)
                return
            except Exception as again:
                exc = again

    async def _all_written(self, records: list[CompletionRecord]) -> bool:
        ids = [record.id for record in records]
        async with self._session_factory() as db:
            found = set((await db.execute(select(Completion.id).where(Completion.id.in_(ids)))).scalars())
        return found == set(ids)

    def _fail(self, pending: _Pending, exc: Exception) -> None:
        ids = ", ".join(record.id for record in pending.records)
        logger.error("could not record completion(s) %s: %s", ids, exc)
        self._metrics.record_failures.inc(len(pending.records))
        if not pending.done.done():
            pending.done.set_exception(exc)
