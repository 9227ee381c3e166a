"""The process pool that CPU-bound graders run in: `ProcessHookPool`, the `HookPool` of the hook runner.

Each item runs in a worker process (started with "spawn": the proxy has threads and an event loop, so it is
never forked) under a hard per-item timeout: past it pebble kills the worker and starts a new one, and the
caller gets `HookTimeoutError`. A worker that dies on its own (killed by the kernel, a segfault) answers
`HookWorkerDiedError`; an exception of the function itself comes back as itself. The event loop is never
blocked: items are awaited through `asyncio.wrap_future`, and cancelling the awaiting task stops the item's
worker.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Any, TypeVar

from pebble import ProcessExpired, ProcessPool
from pebble.common.types import RemoteTraceback

from rewards.hooks.contract import HookTimeoutError

T = TypeVar("T")

logger = logging.getLogger(__name__)


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
        return HookTimeoutError(f"the item ran past its {timeout_s:g} s limit; its worker was killed")
    if isinstance(error, ProcessExpired):
        return HookWorkerDiedError(f"the worker died (exit code {error.exitcode})", error.exitcode)
    if isinstance(error, BrokenProcessPool):
        return HookWorkerDiedError(f"the pool broke before the item ran: {error}")
    return error


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

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T:
        """Run `fn(*args)` in a worker and return its result. Past `timeout_s` seconds of running the
        worker is killed and `HookTimeoutError` raised; a worker that dies raises `HookWorkerDiedError`;
        `fn`'s own exception is raised as itself. An item that never started because the pool broke is
        scheduled once more on a new pool."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        for attempt in (1, 2):
            future = await self._schedule(fn, args, timeout_s)
            try:
                return await asyncio.wrap_future(future)
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
