"""The session finalizer: turns ended, rewarded sessions into trajectories, once each.

Exactly-once rests on the database: `storage.queries.insert_trajectories` moves the session to
"finalized" (`UPDATE … WHERE status <> 'finalized'`) and writes its trajectories in one transaction, and
refuses a session already finalized, so two finalizers (two proxies sweeping one database, or two calls)
never write a session twice; the one that loses finds it finalized and writes nothing. A reward the API
accepted is always in the trajectories, whichever proxy accepted it: `add_reward` locks the session's row
and refuses a finalized one, and the finalizing transaction counts the session's completions and
rewards after it updated that row, building again when one arrived since its snapshot
(`SessionChangedError`). Within one process, `session_guard` also serialises a session's reward writes
with its finalization, so that rebuilding is rare.

When a session is finalized:
- on request (`finalize`, or `schedule(now=True)` — AReaL's end_session): now, with what it has;
- `schedule(session_id)` after an end, a reward or its hooks settling: when it has ended and is ready
  (`rewards.finalize.is_ready`: a session reward, or a reward on every trainable completion; a session
  with reward hooks: once they have all settled, done or failed);
- by the sweep: ended sessions that are ready (catching up after a restart), ended sessions that waited
  `reward_grace_s` for a reward, and sessions still active `session_ttl_s` after creation (ended first).
A session finalized without any reward follows `missing_reward` ("zero" or "drop"), with a warning. A
session whose reward hooks (or its group's) have not settled is never finalized, on request or by the
sweep: its trajectories would lack their rewards.

Retry orphans (rewards/orphans.py: a call the client retried, whose conversation went on from the
retry) are marked `orphan_of` in the finalization's transaction and counted
(`flywheel_retry_orphans_total`); they are left out of the trajectories, and out of what makes a session
ready, unless `train_retry_orphans`.

Calls still in flight: before an ended session is finalized, the process's `CallsInFlight` (the proxy's)
closes it to new calls and the finalization waits until the calls that had started are recorded, so an
answered call is never left out of its session's trajectories. It knows only this process's calls: a
call in flight on another proxy when the session is finalized here is not waited for; its completion is
refused by the database (migration 0006) and the call answered 409 `session_finalized`, never answered
without being trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy import and_, func, or_, select

from rewards.concatenate import build_concatenated_trajectories
from rewards.config import FinalizerConfig
from rewards.finalize import (
    build_session_trajectories,
    combine_rewards,
    is_ready,
    is_trainable,
)
from rewards.orphans import retry_orphans
from rewards.snapshot import SessionSnapshot, load_session_snapshot
from storage.engine import SessionFactory
from storage.errors import is_unavailable
from storage.models import Completion, Session, SessionStatus, as_utc
from storage.queries import SessionChangedError, end_session, insert_trajectories
from storage.records import CompletionRecord, TrajectoryRecord
from storage.reward_jobs import hooks_pending

logger = logging.getLogger(__name__)

_SWEEP_BATCH = 500  # sessions looked at per category and sweep


class SessionActiveError(ValueError):
    """Finalizing needs an ended session: end it first."""


class CallsInFlight(Protocol):
    """The calls each session has running in this process, which its finalization waits for."""

    def close(self, session_id: str) -> None:
        """No call of the session may start from now on."""

    def busy(self, session_id: str) -> bool:
        """Whether a call of the session is running."""

    async def drained(self, session_id: str) -> None:
        """Return once no call of the session is running."""


class FinalizerMetrics:
    """What the finalizer counts, on the registry it is given (the proxy's)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.retry_orphans = Counter(
            "flywheel_retry_orphans", "Retry orphans found in finalized sessions (rewards/orphans.py)",
            registry=self.registry,
        )


@dataclass(eq=False)
class _Guard:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class SessionFinalizer:
    """Builds and writes each ended session's trajectories exactly once (see the module docstring)."""

    def __init__(
        self, session_factory: SessionFactory, config: FinalizerConfig, calls: CallsInFlight | None = None,
        metrics: FinalizerMetrics | None = None,
    ) -> None:
        self._session_factory = session_factory
        self.config = config
        self._calls = calls
        self.metrics = metrics if metrics is not None else FinalizerMetrics()
        self._tasks: set[asyncio.Task[int | None]] = set()
        self._guards: dict[str, _Guard] = {}

    @contextlib.asynccontextmanager
    async def session_guard(self, session_id: str) -> AsyncIterator[None]:
        """Hold while checking a session's status and writing its reward or end: its finalization
        in this process waits for it."""
        guard = self._guards.setdefault(session_id, _Guard())
        guard.users += 1
        try:
            async with guard.lock:
                yield
        finally:
            guard.users -= 1
            if guard.users == 0:
                del self._guards[session_id]

    async def finalize(self, session_id: str) -> int:
        """Finalize an ended session now, with whatever rewards it has, unless its reward hooks are still
        running (it is finalized once they settle). Returns the number of trajectories written: 0 if it was
        finalized already (by anyone, here or by another process), yields none, or waits for its hooks.
        LookupError for an unknown session, SessionActiveError for one not ended."""
        await self._drain(session_id)
        async with self.session_guard(session_id):
            written = await self._finalize_locked(session_id, require_ready=False)
        return written or 0

    async def finalize_if_ready(self, session_id: str) -> int | None:
        """Finalize the session if it has ended and is ready; None (nothing done) otherwise, or when it
        was finalized already (by anyone)."""
        await self._drain(session_id)
        async with self.session_guard(session_id):
            return await self._finalize_locked(session_id, require_ready=True)

    async def _drain(self, session_id: str) -> None:
        """If the session has ended: close it to new calls and wait for those still running (outside its
        guard, so rewards are not held up meanwhile)."""
        if self._calls is None or await self._status(session_id) != SessionStatus.ENDED.value:
            return
        self._calls.close(session_id)
        try:
            await asyncio.wait_for(self._calls.drained(session_id), self.config.call_drain_timeout_s)
        except TimeoutError:
            logger.warning("session %s: calls still running after %.0f s are left out of its trajectories",
                           session_id, self.config.call_drain_timeout_s)

    def schedule(self, session_id: str, *, now: bool = False) -> asyncio.Task[int | None]:
        """Finalize in the background (`now`: whatever its rewards, else only when ready), so an HTTP
        answer does not wait for it; `wait_idle` awaits every scheduled finalization."""
        work = self.finalize(session_id) if now else self.finalize_if_ready(session_id)
        task: asyncio.Task[int | None] = asyncio.create_task(work, name=f"finalize {session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def wait_idle(self) -> None:
        """Return once no scheduled finalization is running (failures are logged, not raised)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def run(self, stop_event: asyncio.Event) -> None:
        """Sweep every `sweep_interval_s` until `stop_event` is set; a failed sweep is logged and the
        next one tries again."""
        while not stop_event.is_set():
            try:
                await self.sweep()
            except Exception as exc:  # a background loop must outlive a database hiccup
                if is_unavailable(exc):  # an outage: one line per sweep, not a trace
                    logger.warning("session sweep: database unavailable (%s); retrying in %.1f s", exc,
                                   self.config.sweep_interval_s)
                else:
                    logger.exception("session sweep failed; retrying in %.1f s", self.config.sweep_interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), timeout=self.config.sweep_interval_s)
        await self.wait_idle()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Sweep in the background while the block runs; on exit the sweeps stop and the finalizations
        in flight finish."""
        stop = asyncio.Event()
        sweeps = asyncio.create_task(self.run(stop), name="session finalizer sweep")
        try:
            yield
        finally:
            stop.set()
            await sweeps

    async def sweep(self) -> int:
        """One pass: end and finalize expired sessions; finalize ended ones that are ready or waited
        long enough for a reward. Returns how many sessions it finalized (not those another process
        finalized meanwhile: when several proxies sweep one database, each session counts in one sweep)."""
        now = datetime.now(UTC)
        expired, ended = await self._due_sessions(now)
        grace_cutoff = now - timedelta(seconds=self.config.reward_grace_s)
        due = [(session_id, ended_at <= grace_cutoff) for session_id, ended_at in ended]
        for session_id in expired:
            if self._calls is not None:
                self._calls.close(session_id)
            if await end_session(self._session_factory, session_id):
                logger.info("session %s: ended by its %.0f s TTL", session_id, self.config.session_ttl_s)
            due.append((session_id, True))  # abandoned: no reward is coming any more
        finalized = 0
        for session_id, waited_enough in due:
            if self._calls is not None:
                self._calls.close(session_id)
                if self._calls.busy(session_id):
                    continue  # the next sweep finalizes it, once its calls are recorded
            async with self.session_guard(session_id):
                done = await self._finalize_locked(session_id, require_ready=not waited_enough)
            finalized += done is not None
        return finalized

    async def _due_sessions(self, now: datetime) -> tuple[list[str], list[tuple[str, datetime]]]:
        ttl_cutoff = now - timedelta(seconds=self.config.session_ttl_s)
        # An online key's session lives as long as its conversation goes on: its TTL counts from its
        # last call. Any other session's counts from its creation.
        last_call = (
            select(func.max(Completion.created_at))
            .where(Completion.session_id == Session.id)
            .scalar_subquery()
        )
        last_active = func.coalesce(last_call, Session.created_at)
        idle = and_(Session.owner_key_hash.is_not(None), last_active <= ttl_cutoff)
        old = and_(Session.owner_key_hash.is_(None), Session.created_at <= ttl_cutoff)
        async with self._session_factory() as db:
            expired = (
                await db.execute(
                    select(Session.id)
                    .where(Session.status == SessionStatus.ACTIVE.value, or_(old, idle))
                    .order_by(Session.created_at)
                    .limit(_SWEEP_BATCH)
                )
            ).scalars()
            ended = (
                await db.execute(
                    select(Session.id, Session.ended_at)
                    .where(Session.status == SessionStatus.ENDED.value, ~hooks_pending())
                    .order_by(Session.ended_at)
                    .limit(_SWEEP_BATCH)
                )
            ).all()
            return list(expired), [(row.id, as_utc(row.ended_at or now)) for row in ended]

    async def _finalize_locked(self, session_id: str, *, require_ready: bool) -> int | None:
        """Under the session's guard: None if not ready (with `require_ready`) or finalized already (here
        or elsewhere), else trajectories written."""
        snapshot = await load_session_snapshot(self._session_factory, session_id, hook_state=True)
        if snapshot is None:
            raise LookupError(f"no session {session_id!r}")
        if snapshot.status == SessionStatus.FINALIZED.value:
            return None
        if snapshot.status == SessionStatus.ACTIVE.value:
            if require_ready:
                return None
            raise SessionActiveError(f"session {session_id} is still active: end it before finalizing")
        if snapshot.hooks_pending:  # not trainable yet: the runner's settling finalizes it (or the sweep)
            return None
        orphans = await asyncio.to_thread(retry_orphans, snapshot.completions)
        completions = self._trained(snapshot.completions, orphans)
        rewards = combine_rewards(snapshot.reward_entries(), self.config.rest_and_hooks)
        trainable = [c.id for c in completions if is_trainable(c)]
        if require_ready and not snapshot.has_hooks and not is_ready(rewards, trainable):
            return None
        trajectories = await asyncio.to_thread(self._trajectories, snapshot, completions)
        try:
            return await self._write(session_id, trajectories, snapshot, orphans)
        except SessionChangedError as exc:  # a call or a reward was recorded meanwhile: build again with it
            logger.info("session %s: changed while finalizing (%s); building it again", session_id, exc)
            return await self._finalize_locked(session_id, require_ready=require_ready)

    def _trained(
        self, completions: tuple[CompletionRecord, ...], orphans: dict[str, str]
    ) -> tuple[CompletionRecord, ...]:
        """The completions trajectories are built from: all, or all but the retry orphans (which no
        completion extends, so every chain stays whole)."""
        if not orphans or self.config.train_retry_orphans:
            return completions
        return tuple(c for c in completions if c.id not in orphans)

    def _trajectories(
        self, snapshot: SessionSnapshot, completions: tuple[CompletionRecord, ...]
    ) -> list[TrajectoryRecord]:
        rewards = combine_rewards(snapshot.reward_entries(), self.config.rest_and_hooks)
        trainable = {c.id for c in completions if is_trainable(c)}
        excluded = len(snapshot.completions) - len(trainable)
        ignored = sorted(set(rewards.completions) - trainable)
        if ignored:
            logger.warning("session %s: rewards on untrainable completions ignored: %s", snapshot.id, ignored)
        if rewards.empty:
            # A session may choose for itself (metadata "missing_reward"): the proxy's per-call admin
            # sessions say "drop", since nobody will reward them.
            policy = snapshot.metadata.get("missing_reward", self.config.missing_reward)
            logger.warning("session %s: finalized without any reward (missing_reward=%s)",
                           snapshot.id, policy)
            if policy == "drop":
                return []
        try:
            if self.config.style == "concatenated":
                trajectories = build_concatenated_trajectories(completions, rewards)
            else:
                trajectories = build_session_trajectories(completions, rewards, self.config.turn_discount)
        except ValueError:
            # Broken history (a missing parent, an overflowing reward): reject the session rather than
            # retry it forever and hold its group back.
            logger.exception("session %s: cannot build trajectories; finalizing it without any", snapshot.id)
            return []
        logger.info(
            "session %s: %d trajectories from %d completions (%d excluded: aborted, empty, unversioned or "
            "retry orphans)",
            snapshot.id,
            len(trajectories),
            len(snapshot.completions),
            excluded,
        )
        return trajectories

    async def _write(
        self, session_id: str, trajectories: list[TrajectoryRecord], snapshot: SessionSnapshot,
        orphans: dict[str, str],
    ) -> int | None:
        """Write the trajectories built from `snapshot`; None when the session was finalized meanwhile
        (by another finalizer: nothing is written here)."""
        try:
            ids = await insert_trajectories(self._session_factory, session_id, trajectories,
                                            len(snapshot.completions), orphans, len(snapshot.rewards))
        except ValueError:
            if await self._status(session_id) != SessionStatus.FINALIZED.value:
                raise
            logger.info("session %s: finalized concurrently elsewhere; nothing written here", session_id)
            return None
        if orphans:
            self.metrics.retry_orphans.inc(len(orphans))
            logger.info("session %s: %d retry orphan(s), %s: %s", session_id, len(orphans),
                        "trained" if self.config.train_retry_orphans else "not trained", sorted(orphans))
        return len(ids)

    async def _status(self, session_id: str) -> str | None:
        async with self._session_factory() as db:
            return await db.scalar(select(Session.status).where(Session.id == session_id))

    def _task_done(self, task: asyncio.Task[int | None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed; the sweep will retry", task.get_name(), exc_info=task.exception())
