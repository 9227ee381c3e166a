"""ProcessHookPool: real spawned workers, a hard per-item timeout, worker deaths, recovery and closing."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rewards.hooks.contract import HookTimeoutError
from rewards.hooks.pool import HookWorkerDiedError, ProcessHookPool
from tests.support import pool_functions as fns

# Every await on the pool is bounded by this, so a broken pool fails the test instead of hanging it.
BOUND_S = 60


@pytest.fixture
async def pool() -> AsyncIterator[ProcessHookPool]:
    hook_pool = ProcessHookPool(1)
    yield hook_pool
    hook_pool.close()


def process_exists(pid: int) -> bool:
    """Whether a process `pid` exists (a reaped worker does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def until_exists(path: Path) -> None:
    """Return once `path` exists (a worker touched it); fail after BOUND_S seconds."""
    for _ in range(BOUND_S * 20):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


async def test_constructing_the_pool_starts_no_process_and_closing_twice_is_fine():
    before = set(multiprocessing.active_children())
    hook_pool = ProcessHookPool(2)
    assert hook_pool.workers == 2
    assert set(multiprocessing.active_children()) == before
    hook_pool.close()
    hook_pool.close()
    assert hook_pool.closed


async def test_a_result_comes_back_from_a_worker_process(pool: ProcessHookPool):
    assert await asyncio.wait_for(pool.run(fns.add, 2, 3, timeout_s=30), BOUND_S) == 5
    assert await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S) != os.getpid()


async def test_the_function_s_own_exceptions_propagate_as_themselves(pool: ProcessHookPool):
    with pytest.raises(ValueError, match="bad input"):
        await asyncio.wait_for(pool.run(fns.fail, "bad input", timeout_s=30), BOUND_S)
    with pytest.raises(TimeoutError, match="the function's own timeout") as raised:
        await asyncio.wait_for(pool.run(fns.raise_timeout_error, timeout_s=30), BOUND_S)
    assert not isinstance(raised.value, HookTimeoutError)
    assert await asyncio.wait_for(pool.run(fns.add, 1, 1, timeout_s=30), BOUND_S) == 2


async def test_an_item_past_its_timeout_raises_and_its_worker_is_replaced(pool: ProcessHookPool):
    first = await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S)
    with pytest.raises(HookTimeoutError):
        await asyncio.wait_for(pool.run(fns.sleep_forever, timeout_s=1), BOUND_S)
    assert not process_exists(first)
    second = await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S)
    assert second != first
    assert await asyncio.wait_for(pool.run(fns.add, 20, 22, timeout_s=30), BOUND_S) == 42


@pytest.mark.parametrize(
    ("function", "args", "exitcode"),
    [(fns.exit_now, (3,), 3), (fns.kill_self, (), -signal.SIGKILL)],
    ids=["os._exit", "SIGKILL"],
)
async def test_a_worker_that_dies_raises_with_its_exit_code_and_the_pool_recovers(
    pool: ProcessHookPool, function, args, exitcode
):
    with pytest.raises(HookWorkerDiedError) as raised:
        await asyncio.wait_for(pool.run(function, *args, timeout_s=30), BOUND_S)
    assert raised.value.exitcode == exitcode
    assert await asyncio.wait_for(pool.run(fns.add, 1, 2, timeout_s=30), BOUND_S) == 3


async def test_an_idle_worker_killed_from_outside_does_not_break_the_pool(pool: ProcessHookPool):
    pid = await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S)
    os.kill(pid, signal.SIGKILL)
    assert await asyncio.wait_for(pool.run(fns.add, 4, 5, timeout_s=30), BOUND_S) == 9
    assert await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S) != pid


async def test_cancelling_the_caller_stops_the_item_s_worker(pool: ProcessHookPool, tmp_path: Path):
    pid = await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S)
    marker = tmp_path / "started"
    task = asyncio.create_task(pool.run(fns.sleep_forever, str(marker), timeout_s=600))
    await until_exists(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.wait_for(pool.run(fns.worker_pid, timeout_s=30), BOUND_S) != pid
    assert not process_exists(pid)


async def test_two_workers_run_two_items_at_once(tmp_path: Path):
    async with ProcessHookPool(2) as hook_pool:
        # Both workers up and idle: each of two items waits for the other, which needs both at once.
        met = await asyncio.wait_for(
            asyncio.gather(
                *(hook_pool.run(fns.rendezvous, str(tmp_path), name, 2, 30.0, timeout_s=45) for name in "ab")
            ),
            BOUND_S,
        )
        assert met == [True, True]
        (start_a, end_a), (start_b, end_b) = await asyncio.wait_for(
            asyncio.gather(*(hook_pool.run(fns.timed_sleep, 1.0, timeout_s=30) for _ in range(2))), BOUND_S
        )
        assert max(start_a, start_b) < min(end_a, end_b)
    assert hook_pool.closed


async def test_closing_fails_a_running_item_and_refuses_new_ones(tmp_path: Path):
    hook_pool = ProcessHookPool(1)
    marker = tmp_path / "started"
    task = asyncio.create_task(hook_pool.run(fns.sleep_forever, str(marker), timeout_s=600))
    await until_exists(marker)
    await asyncio.to_thread(hook_pool.close)
    with pytest.raises(HookWorkerDiedError):
        await asyncio.wait_for(task, BOUND_S)
    with pytest.raises(RuntimeError, match="closed"):
        await hook_pool.run(fns.add, 1, 1, timeout_s=30)


async def test_preloaded_modules_are_imported_when_a_worker_starts():
    async with ProcessHookPool(1, preload=("colorsys", "no_such_module_anywhere")) as hook_pool:
        assert await asyncio.wait_for(hook_pool.run(fns.is_imported, "colorsys", timeout_s=30), BOUND_S)
    async with ProcessHookPool(1) as hook_pool:
        assert not await asyncio.wait_for(hook_pool.run(fns.is_imported, "colorsys", timeout_s=30), BOUND_S)


async def test_workers_run_at_a_lower_cpu_priority_than_the_process_serving_agents():
    async with ProcessHookPool(1, nice=7) as lowered, ProcessHookPool(1) as same:
        mine = os.nice(0)
        assert await asyncio.wait_for(lowered.run(fns.niceness, timeout_s=30), BOUND_S) == min(mine + 7, 19)
        assert await asyncio.wait_for(same.run(fns.niceness, timeout_s=30), BOUND_S) == mine
    with pytest.raises(ValueError, match="nice"):
        ProcessHookPool(1, nice=20)
