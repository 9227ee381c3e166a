"""The completion recorder: group commit of concurrent writes.

Callers `await recorder.record(records)`; one background task drains the queue and writes everything
waiting (up to `batch_max` completions) in one transaction, then resolves each caller's future. While
one transaction runs, the next batch gathers, so throughput grows with concurrency instead of paying
one commit per request. Each transaction is written the cheapest way its database allows
(storage/writer.py: one thread hop per transaction on SQLite). If a batch fails, its entries are
retried one by one, so one bad entry fails only its own caller. A caller gets the exception of its
own failed write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.metrics import ProxyMetrics
from storage.engine import SessionFactory
from storage.records import CompletionRecord
from storage.writer import completion_writer

logger = logging.getLogger(__name__)


class RecorderClosed(RuntimeError):
    """The recorder was stopped; nothing more can be written through it."""


@dataclass(slots=True)
class _Pending:
    records: Sequence[CompletionRecord]
    done: asyncio.Future[None]


class Recorder:
    """Batches completion writes; `start()` inside the running loop, `stop()` drains and ends it."""

    def __init__(self, session_factory: SessionFactory, batch_max: int, metrics: ProxyMetrics) -> None:
        self._session_factory = session_factory
        self._writer = completion_writer(session_factory)
        self._batch_max = batch_max
        self._metrics = metrics
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

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
            await self._write(batch)
        # Anything queued after the stop marker (a race with stop()) still gets an answer.
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                await self._write([item])

    async def _write(self, batch: list[_Pending]) -> None:
        records = [record for pending in batch for record in pending.records]
        started = time.perf_counter()
        try:
            await self._writer.write(records)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
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

    def _fail(self, pending: _Pending, exc: Exception) -> None:
        ids = ", ".join(record.id for record in pending.records)
        logger.error("could not record completion(s) %s: %s", ids, exc)
        self._metrics.record_failures.inc(len(pending.records))
        if not pending.done.done():
            pending.done.set_exception(exc)
