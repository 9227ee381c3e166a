"""The process pool that CPU-bound graders run in: `ProcessHookPool`, the `HookPool` of the hook runner.

Each item runs in a worker process (started with "spawn": the proxy has threads and an event loop, so it is
never forked) under a hard per-item timeout: past it pebble kills the worker and starts a new one, and the
caller gets `HookTimeoutError`. A worker that dies on its own (killed by the kernel, a segfault) answers
`HookWorkerDiedError`; an exception of the function itself comes back as itself. The event loop is never
blocked: items are awaited through `asyncio.wrap_future`, and cancelling the awaiting task stops the item's
worker.

An item's timeout counts only its run time: pebble starts its clock when a worker takes the item, not while
it waits behind other items for a free worker. `JobPool` carries that to a whole job: it is the pool as one
job of the hook runner sees it, and its `WaitClock` stops while the job's items wait for a worker, so that
the runner's per-job timeout does not charge a job for the queue.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Any, TypeVar

from pebble import ProcessExpired, ProcessPool
from pebble.common.types import RemoteTraceback

from rewards.hooks.contract import HookPool, HookTimeoutError

T = TypeVar("T")

logger = logging.getLogger(__name__)

START_POLL_S = 0.05
"""How often a waiting item's future is looked at to learn that a worker took it (a concurrent future
tells its callbacks when it is done, not when it starts running)."""


class HookWorkerDiedError(RuntimeError):
    """A pool worker ended while it ran an item (killed by a signal, `os._exit`, a crash), or the pool
    was closed under it. `exitcode` is the worker's exit status (negative: the signal), None if unknown."""

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


def start_worker(modules: Sequence[str], nice: int) -> None:
    """A worker as it starts: lower its CPU priority by `nice` (graders must not take CPU from the process
    serving agents), then import `modules` before it takes an item, so that a heavy import is not charged
    to the first item's timeout. A module that fails to import is logged and skipped."""
    if nice:
        os.nice(nice)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            logger.warning("pool worker could not preload %s", name, exc_info=True)


def raised_by_function(error: BaseException) -> bool:
    """Whether `error` was raised by the scheduled function in the worker (pebble attaches the remote
    traceback as its cause), rather than by the pool about the worker."""
    return isinstance(error.__cause__, RemoteTraceback)


def original_exception(future: Future[Any], converted: Exception) -> BaseException:
    """The exception `future` holds, as pebble set it: `asyncio.wrap_future` rebuilds a TimeoutError
    without its cause, which is what tells the function's own TimeoutError from the pool's timeout."""
    if future.done() and not future.cancelled():
        error = future.exception()
        if error is not None:
            return error
    return converted


def pool_error(error: BaseException, timeout_s: float) -> BaseException:
    """What `run` raises for `error`, an exception that came out of a pebble future: the pool's own
    timeouts and worker deaths become the hook contract's errors; anything else stays as it is."""
    if raised_by_function(error):
        return error
    if isinstance(error, TimeoutError):
        return HookTimeoutError(
            f"timed out: the item ran past its {timeout_s:g} s limit; its worker was killed"
        )
    if isinstance(error, ProcessExpired):
        return HookWorkerDiedError(f"the worker died (exit code {error.exitcode})", error.exitcode)
    if isinstance(error, BrokenProcessPool):
        return HookWorkerDiedError(f"the pool broke before the item ran: {error}")
    return error


async def until_started(future: Future[Any], result: asyncio.Future[Any]) -> None:
    """Return once a worker took `future`'s item or it ended; cancelled, cancel `result` (its wrapper on the
    event loop), which drops the item from the pool's queue."""
    try:
        while not (future.running() or future.done()):  # noqa: ASYNC110 (no callback says "started")
            await asyncio.sleep(START_POLL_S)
    except asyncio.CancelledError:
        result.cancel()
        raise


def stop_pebble_pool(pool: ProcessPool) -> None:
    """Stop `pool` at once and join its workers and threads (a worker that ignores SIGTERM is killed)."""
    pool.stop()
    pool.join()


class ProcessHookPool:
    """`workers` spawned worker processes running module-level functions with a hard per-item timeout.

    No process starts before the first `run`. A pool that pebble gave up on (an idle worker died) is
    replaced on the next `run`. `close()` stops the workers; an item still running then fails with
    `HookWorkerDiedError`. Also an async context manager that closes on exit.
    """

    def __init__(self, workers: int, *, preload: Sequence[str] = (), nice: int = 0) -> None:
        """`workers` processes at most; `preload`: modules each worker imports as it starts; `nice`: how
        much lower than this process's their CPU priority is."""
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, not {workers}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be within 0..19, not {nice}")
        self.workers = workers
        self.preload = tuple(preload)
        self.nice = nice
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self._pending: set[Future[Any]] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    async def run(
        self, fn: Callable[..., T], *args: Any, timeout_s: float, on_start: Callable[[], None] | None = None
    ) -> T:
        """Run `fn(*args)` in a worker and return its result. Past `timeout_s` seconds of running (time spent
        waiting for a free worker does not count) the worker is killed and `HookTimeoutError` raised; a
        worker that dies raises `HookWorkerDiedError`; `fn`'s own exception is raised as itself. An item
        that never started because the pool broke is scheduled once more on a new pool. `on_start` is
        called once, on the event loop, when the item stops waiting: a worker took it, or it ended
        without one."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        for attempt in (1, 2):
            future = await self._schedule(fn, args, timeout_s)
            try:
                result = asyncio.wrap_future(future)
                if on_start is not None:
                    await until_started(future, result)
                    on_start()
                    on_start = None
                return await result
            except Exception as converted:
                error = original_exception(future, converted)
            broken = isinstance(error, BrokenProcessPool) and not raised_by_function(error)
            if broken and self._closed:
                raise HookWorkerDiedError("the hook pool was closed while the item ran") from error
            if broken and attempt == 1:
                continue
            translated = pool_error(error, timeout_s)
            if translated is error:
                raise error
            raise translated from error
        raise AssertionError("unreachable")

    async def _schedule(self, fn: Callable[..., T], args: tuple[Any, ...], timeout_s: float) -> Future[T]:
        """Schedule one item on the live pebble pool (replacing, and then stopping, a broken one) and
        track its future."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the hook pool is closed")
            retired = self._replace_broken_pool()
            if self._pool is None:
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    initializer=start_worker,
                    initargs=(self.preload, self.nice),
                    context=self._context,
                )
            future: Future[T] = self._pool.schedule(fn, args=args, timeout=timeout_s)
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        if retired is not None:
            try:
                await asyncio.to_thread(stop_pebble_pool, retired)
            except BaseException:
                future.cancel()
                raise
        return future

    def _replace_broken_pool(self) -> ProcessPool | None:
        """Forget the pebble pool if pebble gave up on it (it is no longer active) and return it, for the
        caller to stop; None when it is fine or there is none. Called with the lock held."""
        if self._pool is None or self._pool.active:
            return None
        retired, self._pool = self._pool, None
        return retired

    def close(self) -> None:
        """Stop and join the workers; an item still running fails with `HookWorkerDiedError`. Later
        calls do nothing, and `run` raises RuntimeError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            stop_pebble_pool(pool)
        for future in tuple(self._pending):
            if not future.done():
                try:
                    future.set_exception(HookWorkerDiedError("the hook pool was closed while the item ran"))
                except InvalidStateError:
                    pass
        self._pending.clear()

    async def __aenter__(self) -> ProcessHookPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.close)


class WaitClock:
    """A job's run time, which leaves out the time it spends waiting for a pool worker: the clock stops while
    at least one of the job's items waits for a worker and none of them runs."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._started = now()
        self._waiting = 0
        self._running = 0
        self._stopped_at: float | None = None
        self._waited_s = 0.0

    @property
    def waiting(self) -> bool:
        """Whether the job only waits for a worker now (its clock is stopped)."""
        return self._stopped_at is not None

    def elapsed(self) -> float:
        """Seconds since the job started, waits included."""
        return self._now() - self._started

    def waited(self) -> float:
        """Seconds the job has spent waiting for a worker."""
        ongoing = 0.0 if self._stopped_at is None else self._now() - self._stopped_at
        return self._waited_s + ongoing

    def run_time(self) -> float:
        """Seconds the job has run: elapsed, less its waits."""
        return self.elapsed() - self.waited()

    def queued(self) -> None:
        """One of the job's items was handed to the pool and waits for a worker."""
        self._waiting += 1
        self._update()

    def started(self) -> None:
        """One of the job's waiting items left the queue (a worker took it)."""
        self._waiting -= 1
        self._running += 1
        self._update()

    def finished(self, started: bool) -> None:
        """One of the job's items ended; `started`: whether it had left the queue."""
        if started:
            self._running -= 1
        else:
            self._waiting -= 1
        self._update()

    def _update(self) -> None:
        stop = self._waiting > 0 and self._running == 0
        if stop and self._stopped_at is None:
            self._stopped_at = self._now()
        elif not stop and self._stopped_at is not None:
            self._waited_s += self._now() - self._stopped_at
            self._stopped_at = None


class JobPool:
    """The hook runner's pool as one job sees it: each item's wait for a worker stops the job's `clock`. A
    pool that cannot tell when an item starts (not a `ProcessHookPool`) counts the whole item as run time."""

    def __init__(self, pool: HookPool, clock: WaitClock) -> None:
        self.pool = pool
        self.clock = clock

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        if not isinstance(self.pool, ProcessHookPool):
            return await self.pool.run(fn, *args, timeout_s=timeout_s)
        started = False

        def on_start() -> None:
            nonlocal started
            started = True
            self.clock.started()

        self.clock.queued()
        try:
            return await self.pool.run(fn, *args, timeout_s=timeout_s, on_start=on_start)
        finally:
            self.clock.finished(started)
