"""Streaming generations that survive weight pushes and lost workers: the worker's cumulative chunks
relayed as if one request made them all (the pieces and their stitching: proxy/workers/resume.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

from proxy.workers.plan import GenerationPlan, finish_type, no_worker_error
from proxy.workers.resume import (
    Chunks,
    Prefix,
    ResumeBudget,
    is_lost,
    merge,
    resumable,
    resume_request,
    stop_strings,
    stopped_at,
    straddling_stop,
    with_length_finish,
)
from proxy.workers.routing import Balancer, Worker
from serving.client import GenerateRequest
from serving.errors import WorkerConnectionError, WorkerError

logger = logging.getLogger(__name__)


class ResumingStream:
    """A streaming generation's cumulative chunks, as if one worker request made them all: a choice
    aborted by a pause or cut off by a lost worker continues as a new request (one per choice, side by
    side) whose chunks are merged onto what was already streamed. A lease on each worker is held while
    it is read; `worker` is the one read last (where an abort must go)."""

    def __init__(self, balancer: Balancer, plan: GenerationPlan) -> None:
        self.worker: Worker | None = None
        self._balancer = balancer
        self._plan = plan
        self._last: dict[int, dict[str, Any]] = {}
        self._prefix: dict[int, Prefix] = {}
        self._lost: set[Worker] = set()
        self._lost_error: WorkerError | None = None
        self._stops = stop_strings(plan)
        self._chunks = self._run()

    def __aiter__(self) -> Chunks:
        # The generator itself: `async for` then steps it directly, with no coroutine of ours per chunk.
        return self._chunks

    async def __anext__(self) -> dict[str, Any]:
        return await anext(self._chunks)

    async def aclose(self) -> None:
        """Stop reading (closing the worker connections, which aborts there) and end the leases."""
        await self._chunks.aclose()

    def _unfinished(self, index: int) -> bool:
        last = self._last.get(index)
        return last is None or finish_type(last) is None or resumable(last)

    async def _run(self) -> Chunks:
        # Each inner generator is closed as soon as this one is, so its lease and connection end then
        # (try/finally rather than contextlib.aclosing: the same, without its object and frames per call).
        relay = self._relay(self._plan.worker_request, None)
        try:
            async for merged in relay:
                yield merged
        finally:
            await relay.aclose()
        pending = [index for index in range(self._plan.n) if self._unfinished(index)]
        if not pending:
            return
        resumed = self._resume(pending[0]) if len(pending) == 1 else interleave(
            [self._resume(index) for index in pending])
        async with contextlib.aclosing(resumed) as chunks:
            async for merged in chunks:
                yield merged

    async def _resume(self, index: int) -> Chunks:
        """Choice `index` continued until it finishes (or its budget ends)."""
        budget = ResumeBudget(self._balancer.policy)
        while self._unfinished(index):
            last = self._last.get(index)
            prefix = Prefix.of(last, self._balancer.decode) if last is not None else Prefix.empty()
            request = resume_request(self._plan, index, prefix, budget.used + 1)
            if last is not None and request is None:  # aborted after its last token
                yield with_length_finish(last, len(prefix.output_ids))
                return
            if request is None or not budget.take():
                if last is None or finish_type(last) is None:  # cut off: the stream ends in error
                    raise self._lost_error or no_worker_error(self._balancer)
                logger.warning("%s: gave up resuming after %d attempts", self._plan.completion_ids[index],
                               budget.used)
                yield last  # recorded as aborted
                return
            self._balancer.count_resume("abort" if last is not None and finish_type(last) else "lost")
            self._prefix[index] = prefix
            async with contextlib.aclosing(self._relay(request, index)) as relay:
                async for merged in relay:
                    yield merged
            now = self._last.get(index) or {}
            await budget.after(len(now.get("output_ids") or ()) > len(prefix.output_ids))

    async def _relay(
        self, request: GenerateRequest, index: int | None
    ) -> Chunks:
        """One worker stream of `request` (choice `index`, or all choices), merged and relayed; an abort
        chunk is held back (the caller resumes that choice). Fails over while nothing was received; a
        worker lost after that just ends the relay (the caller resumes what is unfinished)."""
        session_id = self._plan.session_id
        # Chunks that queued up are skipped (only the newest of each counts), except where a stop
        # string may straddle the resume boundary: its end is found chunk by chunk.
        coalesce = index is None or not self._stops
        for worker in self._balancer.candidates(session_id):
            if worker in self._lost:
                continue
            self.worker = worker
            received = False
            try:
                with self._balancer.lease(worker, session_id):
                    stream = cast(Chunks, worker.client.generate_stream(request, coalesce=coalesce))
                    try:
                        async for raw in stream:
                            received = True
                            merged = self._take(raw, index)
                            if index is not None and (stopped := self._straddled(index, merged)):
                                yield stopped  # leaving the stream closes it: the worker aborts
                                break
                            if not resumable(merged):
                                yield merged
                    finally:
                        await stream.aclose()
                self._balancer.mark_ok(worker)
                return
            except WorkerError as exc:
                if not is_lost(exc):
                    raise
                kind = "connect" if isinstance(exc, WorkerConnectionError) else "http"
                self._balancer.mark_failed(worker, kind)
                self._lost.add(worker)
                self._lost_error = exc
                if received:
                    return
        raise self._lost_error or no_worker_error(self._balancer)

    def _straddled(self, index: int, merged: dict[str, Any]) -> dict[str, Any] | None:
        """The resumed choice's end, if a stop string straddling the boundary has just completed (chunk
        by chunk, the tokens so far are exactly those that complete it)."""
        prefix = self._prefix.get(index)
        if prefix is None or not prefix.output_ids or not self._stops:
            return None
        found = straddling_stop(prefix, str(merged.get("text", "")), self._stops)
        if found is None:
            return None
        self._last[index] = stopped = stopped_at(merged, *found)
        return stopped

    def _take(self, raw: dict[str, Any], index: int | None) -> dict[str, Any]:
        multi = self._plan.n > 1
        i = index if index is not None else (int(raw.get("index", 0)) if multi else 0)
        prefix = self._prefix.get(i)
        merged = merge(prefix, raw, self._balancer.decode) if prefix is not None else raw
        if multi and merged.get("index") != i:
            merged = {**merged, "index": i}
        self._last[i] = merged
        return merged


async def interleave(
    sources: list[Chunks],
) -> Chunks:
    """The items of several async generators as they come, each read by its own task; the first
    failure ends it all, and closing it closes every source."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def drain(source: Chunks) -> None:
        try:
            async for item in source:
                queue.put_nowait(("item", item))
        except Exception as exc:  # a task boundary: the failure is the reader's to raise
            queue.put_nowait(("error", exc))
            return
        queue.put_nowait(("done", None))

    tasks = [asyncio.create_task(drain(source)) for source in sources]
    try:
        running = len(tasks)
        while running:
            kind, item = await queue.get()
            if kind == "item":
                yield item
            elif kind == "done":
                running -= 1
            else:
                raise item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await source.aclose()
