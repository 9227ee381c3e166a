"""The hook runner: claims due reward hook jobs (storage/reward_jobs.py), runs each with its timeout, at most
`concurrency` at once, and settles it: its rewards written once, or the failure recorded and retried with
backoff, then marked failed. It runs inside the proxy by default, or as its own `flywheel rewards`
process; any number of runners may share one database.

Nothing is lost or doubled when a runner dies: a job's rewards and its "done" are one transaction, taken
only while the runner still holds the job's lease, and a job whose lease expires is run again by whoever
claims it next. A runner that stops cleanly hands its running jobs back.

A job's timeout counts its run time only. With more jobs at once (`concurrency`) than pool workers
(`workers`), a function hook's item may wait behind others for a worker; that wait stops the job's clock
(`WaitClock`, rewards/hooks/pool.py), and the runner extends the job's lease while it waits so that no other
runner takes it over. A wedged pool still cannot hold a job forever: its total time, waits included, is
capped at `job_time_cap` (its timeout plus `concurrency` times the longer of its timeout and the default
one), past which it fails with a TimeoutError and is retried like any other timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import httpx

from rewards.config import HookRunnerConfig
from rewards.hooks.adapters import HookConfigError
from rewards.hooks.contract import GroupInput, Hook, HookContext, HookLevel, HookPool, SessionInput
from rewards.hooks.pool import JobPool, ProcessHookPool, WaitClock
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec
from rewards.inputs import group_input, session_input
from rewards.labels import JobOutcome, reward_rows
from rewards.metrics import HookMetrics
from rewards.snapshot import load_session_snapshot
from storage.engine import SessionFactory
from storage.errors import is_unavailable
from storage.reward_jobs import (
    ClaimedJob,
    claim_jobs,
    complete_job,
    extend_lease,
    fail_job,
    group_members,
    release_job,
)

logger = logging.getLogger(__name__)

Settled = Callable[[Sequence[str]], None]
"""Told the sessions whose hooks just settled a job (the proxy's finalizer finalizes them when ready)."""


def retry_delay(attempts: int, config: HookRunnerConfig) -> float:
    """Backoff before the next try after `attempts` runs: `backoff_s` doubling, at most `backoff_max_s`."""
    return float(min(config.backoff_s * 2 ** max(attempts - 1, 0), config.backoff_max_s))


def job_timeout(spec: HookSpec, config: HookRunnerConfig) -> float:
    return spec.timeout_s if spec.timeout_s is not None else config.timeout_s


def job_time_cap(timeout_s: float, config: HookRunnerConfig) -> float:
    """The most a job may take, waits for a pool worker included: its run time, plus a wait as long as every
    other job this runner holds running to the longer of its own and the default limit first (one worker)."""
    return timeout_s + config.concurrency * max(timeout_s, config.timeout_s)


def lease_check_interval(config: HookRunnerConfig) -> float:
    """How often a job waiting for a pool worker checks its lease: often enough that the lease, renewed
    once less than half the margin is left beyond the job's deadline, never runs out."""
    return config.lease_margin_s / 4


class LeaseLostError(Exception):
    """Another runner took the job over while it waited for a pool worker."""


class HookRunner:
    """Runs reward hook jobs from the database until stopped (see the module docstring)."""

    def __init__(
        self,
        session_factory: SessionFactory,
        registry: HookRegistry,
        config: HookRunnerConfig,
        *,
        metrics: HookMetrics | None = None,
        on_settled: Settled | None = None,
        pool: HookPool | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._registry = registry
        self.config = config
        self._metrics = metrics or HookMetrics()
        self._on_settled = on_settled
        self._pool = pool
        self._http: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._metrics.track_jobs(lambda: len(self._tasks))
        self._wake = asyncio.Event()

    @contextlib.asynccontextmanager
    async def _resources(self) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if self._pool is None:
                # Workers import math-verify (and sympy) as they start, not inside a graded item's time.
                pool = ProcessHookPool(self.config.workers, preload=("math_verify",),
                                       nice=self.config.worker_nice)
                self._pool = await stack.enter_async_context(pool)  # closed off the event loop
            self._http = await stack.enter_async_context(httpx.AsyncClient(follow_redirects=False))
            try:
                yield
            finally:
                await self._stop_tasks()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HookRunner]:
        """Run in the background while the block runs; on exit running jobs are handed back."""
        stop = asyncio.Event()
        loop = asyncio.create_task(self.run(stop), name="reward hook runner")
        try:
            yield self
        finally:
            stop.set()
            self._wake.set()
            await loop

    async def run(self, stop: asyncio.Event) -> None:
        """Claim and run due jobs until `stop` is set."""
        async with self._resources():
            while not stop.is_set():
                claimed = await self._claim_some()
                if claimed == 0 or len(self._tasks) >= self.config.concurrency:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)

    def wake(self) -> None:
        """Look for due jobs now (a session just ended in this process)."""
        self._wake.set()

    async def _claim_some(self) -> int:
        free = self.config.concurrency - len(self._tasks)
        if free <= 0:
            return 0
        lease_s = self.config.timeout_s + self.config.lease_margin_s
        claimed_at = time.monotonic()  # no later than the lease's start: its end is estimated early
        try:
            jobs = await claim_jobs(self._session_factory, free, lease_s)
        except Exception as exc:  # a background loop outlives a database hiccup
            if is_unavailable(exc):
                logger.warning("reward hooks: database unavailable (%s); retrying", exc)
            else:
                logger.exception("reward hooks: claiming jobs failed; retrying")
            return 0
        for job in jobs:
            task = asyncio.create_task(self._run_job(job, claimed_at + lease_s),
                                       name=f"reward job {job.id} ({job.source})")
            self._tasks.add(task)
            task.add_done_callback(self._job_done)
        return len(jobs)

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", task.get_name(), exc_info=task.exception())

    async def _stop_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run_job(self, job: ClaimedJob, lease_until: float) -> None:
        started = time.monotonic()
        try:
            outcome = await self._attempt(job, lease_until)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await release_job(self._session_factory, job)
            raise
        self._metrics.observe(job.source, outcome.state, time.monotonic() - started)
        if outcome.state in ("done", "failed") and self._on_settled is not None:
            self._on_settled(outcome.session_ids)

    async def _attempt(self, job: ClaimedJob, lease_until: float) -> JobOutcome:
        level: HookLevel = "group" if job.group_id is not None else "session"
        try:
            spec = HookSpec.model_validate(job.spec)
            hook = self._registry.resolve(spec, level)
            subject = await self._load(job)
        except HookConfigError as exc:  # will not get better by retrying
            return await self._failed(job, f"hook unusable: {exc}", final=True, sessions=())
        sessions = [s.session_id for s in subject.sessions] if isinstance(subject, GroupInput) else [
            subject.session_id]
        timeout_s = job_timeout(spec, self.config)
        try:
            result = await self._run_hook(job, hook, subject, timeout_s, lease_until)
            rows, summary = reward_rows(result, subject, spec.weight)
        except asyncio.CancelledError:
            raise
        except LeaseLostError:
            return JobOutcome("lost", ())
        except TimeoutError as exc:
            # The job's own limit, or one item of its work past its limit in the pool (HookTimeoutError).
            error = f"{type(exc).__name__}: {exc}" if str(exc) else f"timed out after {timeout_s:g} s"
            return await self._failed(job, error, final=False, sessions=sessions)
        except Exception as exc:
            return await self._failed(job, f"{type(exc).__name__}: {exc}", final=False, sessions=sessions)
        if not await complete_job(self._session_factory, job, rows, summary):
            logger.warning("reward job %d (%s): its lease was taken over; its result is dropped", job.id,
                           job.source)
            return JobOutcome("lost", ())
        return JobOutcome("done", tuple(sessions))

    async def _run_hook(
        self, job: ClaimedJob, hook: Hook, subject: SessionInput | GroupInput, timeout_s: float,
        lease_until: float,
    ) -> Any:
        """Run `hook` on `subject` for at most `timeout_s` seconds of run time (see the module docstring):
        its result, TimeoutError past its limit or its cap, LeaseLostError when the job was taken over."""
        assert self._pool is not None
        clock = WaitClock()
        context = HookContext(job_id=f"{job.session_id or job.group_id}/{job.source}", attempt=job.attempts,
                              timeout_s=timeout_s, pool=JobPool(self._pool, clock), http=self._http)
        task = asyncio.ensure_future(hook(subject, context))
        try:
            return await self._watch(job, task, clock, timeout_s, lease_until)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _watch(
        self, job: ClaimedJob, task: asyncio.Future[Any], clock: WaitClock, timeout_s: float,
        lease_until: float,
    ) -> Any:
        """Wait for `task`, renewing the job's lease while the job's deadline moves (it waits for a worker)
        or lies beyond it (a hook timeout longer than the claim's lease)."""
        margin_s = self.config.lease_margin_s
        cap_s = job_time_cap(timeout_s, self.config)
        while True:
            left_s = timeout_s - clock.run_time()
            if left_s <= 0:
                raise TimeoutError(f"timed out after {timeout_s:g} s")
            if clock.elapsed() >= cap_s:
                raise TimeoutError(f"gave up after {cap_s:g} s, {clock.waited():.1f} s of it waiting for a "
                                   "hook pool worker")
            now = time.monotonic()
            if lease_until - (now + left_s) < margin_s / 2:
                lease_until = await self._renew_lease(job, now, left_s + margin_s, lease_until)
            wake_s = min(left_s, cap_s - clock.elapsed())
            if clock.waiting:
                wake_s = min(wake_s, lease_check_interval(self.config))
            done, _ = await asyncio.wait({task}, timeout=max(wake_s, 0.0))
            if done:
                return task.result()

    async def _renew_lease(self, job: ClaimedJob, now: float, lease_s: float, lease_until: float) -> float:
        """Hold the job `lease_s` from `now`: the lease's new end (the old one when the database could not be
        reached: the next check tries again); LeaseLostError when another runner holds the job."""
        try:
            held = await extend_lease(self._session_factory, job, lease_s)
        except Exception as exc:  # a database hiccup; the lease still has part of its margin
            logger.warning("reward job %d (%s): could not extend its lease (%s); retrying", job.id,
                           job.source, exc)
            return lease_until
        if not held:
            raise LeaseLostError(f"reward job {job.id} was taken over")
        return now + lease_s

    async def _failed(
        self, job: ClaimedJob, error: str, *, final: bool, sessions: Sequence[str]
    ) -> JobOutcome:
        delay = retry_delay(job.attempts, self.config)
        if final:  # no attempt left to make
            job = dataclasses.replace(job, max_attempts=job.attempts)
        state = await fail_job(self._session_factory, job, error, delay)
        if state is None:
            return JobOutcome("lost", ())
        log = logger.error if state == "failed" else logger.warning
        log("reward job %d (%s) attempt %d of %d: %s%s", job.id, job.source, job.attempts, job.max_attempts,
            error, "; giving up" if state == "failed" else f"; retrying in {delay:g} s")
        if not sessions and job.session_id is not None:
            sessions = (job.session_id,)
        return JobOutcome("failed" if state == "failed" else "retry", tuple(sessions))

    async def _load(self, job: ClaimedJob) -> SessionInput | GroupInput:
        if job.session_id is not None:
            snapshot = await load_session_snapshot(self._session_factory, job.session_id)
            if snapshot is None:
                raise HookConfigError(f"session {job.session_id} is gone")
            return session_input(snapshot)
        assert job.group_id is not None
        try:
            task, members = await group_members(self._session_factory, job.group_id)
        except LookupError as exc:
            raise HookConfigError(str(exc)) from exc
        snapshots = []
        for session_id in members:
            snapshot = await load_session_snapshot(self._session_factory, session_id)
            if snapshot is not None:
                snapshots.append(snapshot)
        return group_input(job.group_id, task, snapshots)

