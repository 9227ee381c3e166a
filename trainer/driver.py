"""The trainer's loop (docs/architecture.md, "One training step"): claim → train → save → push → record,
one policy version per step.

Step `s` trains the policy of version `s − 1` on samples at most η versions older, and produces
version `s`; its checkpoint is pushed to every worker before the step, the new version and the
consumed trajectory ids are recorded in one transaction. A failure anywhere after the claim releases
the claim (no sample is lost) and stops the loop: the actor's weights may then be ahead of what was
recorded, and a restart resumes from the last recorded version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from serving.client import SGLangClient
from storage.claims import claim_batch, record_step, release_claim
from storage.engine import SessionFactory
from storage.policy_versions import (
    best_version,
    candidates,
    mark_served,
    next_version,
    protected_versions,
    record_evaluation,
    record_initial,
    served_version,
    settle,
)
from storage.records import ClaimedBatch, StepRecord, TrainingSample
from trainer.checkpoint import (
    discard_unrecorded,
    forget_claim,
    prune_checkpoints,
    remember_claim,
    remembered_claim,
)
from trainer.config import TrainerConfig
from trainer.metrics import WatchedSync
from trainer.monitor import Monitor, finite_metrics
from trainer.promotion import CandidateGate, decide
from trainer.weights.disk import served_versions, weight_version_label
from trainer.weights.sync import DiskSync, WeightSync

logger = logging.getLogger(__name__)


class PolicyHandle(Protocol):
    """What the driver needs of the policy (the Ray actor's methods, awaited)."""

    async def train_step(
        self, samples: Sequence[TrainingSample], current_version: int
    ) -> dict[str, float]: ...
    async def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str: ...
    async def load(self, checkpoint_path: str) -> None: ...
    async def model_dir(self) -> str: ...


class Driver:
    """Runs steps until `total_steps` is reached or `stop` is set (checked between steps). Weights reach the
    workers through `sync` (default: `DiskSync`, a checkpoint read from a shared filesystem). With a `gate`
    (eval-gated promotion, trainer/promotion.py) each new version is a candidate until its evaluation
    promotes it; the driver then trains on from the version it promoted, or from the best one."""

    def __init__(
        self,
        config: TrainerConfig,
        session_factory: SessionFactory,
        policy: PolicyHandle,
        clients: Sequence[SGLangClient],
        checkpoint_dir: Path,
        monitor: Monitor,
        gate: CandidateGate | None = None,
        sync: WeightSync | None = None,
    ) -> None:
        self._config = config
        self._sync = WatchedSync(sync if sync is not None else DiskSync(config.weights), monitor)
        self._db = session_factory
        self._policy = policy
        self._clients = list(clients)
        self._checkpoint_dir = checkpoint_dir
        self._monitor = monitor
        self._gate = gate
        self._newest = 0
        self._dropped = 0  # samples the claims dropped as older than η since the last recorded step

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Train until done or stopped; returns the version training goes on from (the last recorded one;
        with a gate, the last promoted one or the best)."""
        config = self._config
        version = await self.resume()
        claim_token = None
        while not (stop is not None and stop.is_set()) and not self._done():
            if claim_token is None:  # noted before the claim: a restart gives it back wherever this died
                claim_token = str(uuid.uuid4())
                remember_claim(self._checkpoint_dir, claim_token)
            batch = await claim_batch(
                self._db,
                config.batch_size,
                version,
                config.max_head_offpolicyness,
                lease_s=config.claim_lease_s,
                drop_stale=True,
                claim_token=claim_token,
            )
            self._dropped += batch.dropped
            self._monitor.claimed(len(batch), batch.dropped)
            if not batch.samples:
                await _sleep(config.poll_interval_s, stop)
                continue
            claim_token = None
            version = await self._step(batch, version)
            forget_claim(self._checkpoint_dir)  # consumed
        return version

    async def resume(self) -> int:
        """The version to train from: the last recorded one (with a gate: the best promoted one, after
        settling candidates a stopped run left unevaluated). Its checkpoint (weights and trainer state) goes
        into the actor, so the next step is the one an uninterrupted run would take; the served version
        goes to any worker serving something else (a worker restarted, or one that loaded a step that was
        never recorded).

        What a step that died left behind is undone first: the samples it claimed are given back at once
        (not when the claim's lease ends), a checkpoint of a version never recorded is discarded, and
        workers it left paused in a push continue."""
        await self._give_back_dead_claim()
        model_dir = await self._policy.model_dir()
        if self._gate is not None:
            await self._settle_leftovers(model_dir)
        self._newest = max(await next_version(self._db) - 1, 0)
        discard_unrecorded(self._checkpoint_dir, self._newest)
        best = await best_version(self._db)
        version = 0 if best is None else best.version
        if version > 0 and best is not None:
            await self._policy.load(best.checkpoint_path)
        served = await served_version(self._db)
        if served is None:
            await self._sync_workers(model_dir, 0)
        else:
            await self._sync_workers(served.checkpoint_path if served.version else model_dir, served.version)
        self._monitor.served(0 if served is None else served.version)
        logger.info("trainer at policy version %d, serving %s", version, served and served.version)
        return version

    async def _give_back_dead_claim(self) -> None:
        """Release the claim of the step in flight when the trainer last stopped: a step that finished
        consumed it (nothing is released), one that died still holds it."""
        token = remembered_claim(self._checkpoint_dir)
        if token is None:
            return
        released = await release_claim(self._db, token)
        forget_claim(self._checkpoint_dir)
        if released:
            logger.warning("gave back %d trajectories claimed by a step that never finished", released)

    async def _resumable(self, version: int) -> set[int]:
        """Versions training may go on from, whose checkpoints keep their trainer state: `version`, the
        best version (a rejected candidate goes back to it) and candidates waiting for a verdict."""
        best = await best_version(self._db)
        waiting = {info.version for info in await candidates(self._db)}
        return waiting | {version} | ({best.version} if best is not None else set())

    async def _step(self, batch: ClaimedBatch, version: int) -> int:
        new_version = await next_version(self._db)
        gated = self._gate is not None
        started = time.perf_counter()
        try:
            stats = await self._policy.train_step(batch.samples, version)
            stats["staleness/dropped"] = float(self._dropped)
            saved = time.perf_counter()
            path = await self._policy.save(str(self._checkpoint_dir), new_version, with_state=True)
            stats["perf/save_s"] = time.perf_counter() - saved
            if not gated:
                stats["perf/push_s"] = await self._sync.push(self._clients, path, new_version)
                stats["perf/weight_sync_s"] = stats["perf/save_s"] + stats["perf/push_s"]
            stats["perf/step_s"] = time.perf_counter() - started
            metrics = finite_metrics(stats)
            record = StepRecord(
                step=new_version,
                policy_version=new_version,
                checkpoint_path=path,
                metrics=metrics,
                parent_version=version,
                candidate=gated,
            )
            await record_step(self._db, record, batch.claim_token, batch.ids)
            self._dropped = 0
        except BaseException:
            released = await release_claim(self._db, batch.claim_token)
            logger.exception(
                "step %d failed after claiming %d trajectories; released %d",
                new_version,
                len(batch),
                released,
            )
            raise
        self._newest = new_version
        self._monitor.record(new_version, new_version, metrics)
        if gated:
            version = await self._judge(new_version, path)
        else:
            version = new_version
        protect = await protected_versions(self._db) | {version, new_version}
        resumable = await self._resumable(version)
        prune_checkpoints(self._checkpoint_dir, self._config.keep_checkpoints, protect, resumable)
        return version

    async def _judge(self, candidate: int, path: str) -> int:
        """Evaluate a recorded candidate and promote (push, then record it promoted and served) or reject
        it (record it, go back to the best version's weights and optimiser state, and serve the best
        version if another one is served). Returns the version training goes on from."""
        assert self._gate is not None
        started = time.perf_counter()
        result = await self._gate.evaluate(path, candidate)
        eval_s = time.perf_counter() - started
        best = await best_version(self._db)
        decision = decide(result, None if best is None else best.evaluation, self._config.promotion)
        details = {**result.details, "eval_s": eval_s}
        if decision.promote:
            push_s = await self._sync.push(self._clients, path, candidate)
            evaluated = replace(result, details={**details, "push_s": push_s})
            reason = decision.reason
            await settle(self._db, candidate, promoted=True, result=evaluated, reason=reason, served=True)
            logger.info("promoted version %d: %s", candidate, decision.reason)
            return candidate
        evaluated = replace(result, details=details)
        await settle(self._db, candidate, promoted=False, result=evaluated, reason=decision.reason)
        logger.warning("rejected version %d: %s", candidate, decision.reason)
        assert best is not None  # `decide` promotes whatever it has nothing to compare with
        await self._policy.load(best.checkpoint_path)
        served = await served_version(self._db)
        if served is None or served.version != best.version:
            await self._sync.push(self._clients, best.checkpoint_path, best.version)
            await mark_served(self._db, best.version)
            logger.warning("serving rolled back to version %d", best.version)
        return best.version

    async def _settle_leftovers(self, model_dir: str) -> None:
        """Gating needs a scored version to compare with: evaluate the initial weights (or the best version
        of a run that was not gated) once; then settle candidates a stopped run left unevaluated."""
        assert self._gate is not None
        best = await best_version(self._db)
        if best is None:
            await record_initial(self._db, model_dir, await self._gate.evaluate(model_dir, 0))
        elif best.eval_score is None:
            path = best.checkpoint_path if best.version else model_dir
            await record_evaluation(self._db, best.version, await self._gate.evaluate(path, best.version))
        for waiting in await candidates(self._db):
            await self._judge(waiting.version, waiting.checkpoint_path)

    async def _sync_workers(self, path: str, version: int) -> None:
        label = weight_version_label(version)
        served = await served_versions(self._clients)
        behind = [c for c in self._clients if served[c.base_url] != label]
        if behind:
            logger.info(
                "workers %s serve %s, not %s: pushing %s",
                [c.base_url for c in behind],
                [served[c.base_url] for c in behind],
                label,
                path,
            )
            await self._sync.push(behind, path, version)
        if self._config.weights.pause_mode is not None:  # a push that died may have left them paused
            await asyncio.gather(*(c.continue_generation() for c in self._clients if c not in behind))

    def _done(self) -> bool:
        return self._config.total_steps is not None and self._newest >= self._config.total_steps


async def _sleep(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep, waking early when `stop` is set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
