"""storage.writer.CallThread: the SQLite writer's thread hop runs calls in order on its own thread and
hands back their results and exceptions; a caller that stops waiting does not stop the thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from storage.writer import CallThread


async def test_results_exceptions_and_order() -> None:
    thread = CallThread("test-call-thread")
    seen: list[tuple[int, str]] = []

    def note(value: int) -> int:
        seen.append((value, threading.current_thread().name))
        return value * 2

    def fail() -> None:
        raise ValueError("boom")

    try:
        assert await asyncio.gather(*(thread.run(note, i) for i in range(20))) == [i * 2 for i in range(20)]
        assert seen == [(i, "test-call-thread") for i in range(20)]
        with pytest.raises(ValueError, match="boom"):
            await thread.run(fail)
        assert await thread.run(note, 21) == 42  # the thread survives a failed call
    finally:
        thread.stop()


async def test_a_cancelled_wait_leaves_the_call_running() -> None:
    thread = CallThread("test-call-thread")
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(5)
        return "done"

    try:
        waiting = asyncio.create_task(thread.run(slow))
        await asyncio.to_thread(started.wait, 5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        assert await thread.run(str, 7) == "7"  # the cancelled call finished; the next one runs
    finally:
        thread.stop()
