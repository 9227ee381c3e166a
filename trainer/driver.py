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
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import select

from serving.client import SGLangClient
from storage.claims import claim_batch, latest_policy_version, record_step, release_claim
from storage.engine import SessionFactory
from storage.models import PolicyVersion
from storage.records import ClaimedBatch, StepRecord, TrainingSample
from trainer.checkpoint import prune_checkpoints
from trainer.config import TrainerConfig
from trainer.monitor import Monitor, finite_metrics
from trainer.weights.disk import push_weights, served_versions, weight_version_label

logger = logging.getLogger(__name__)


class PolicyHandle(Protocol):
    """What the driver needs of the policy (the Ray actor's methods, awaited)."""

    async def train_step(
        self, samples: Sequence[TrainingSample], current_version: int
    ) -> dict[str, float]: ...
    async def save(self, checkpoint_dir: str, version: int) -> str: ...
    async def load(self, checkpoint_path: str) -> None: ...
    async def model_dir(self) -> str: ...


class Driver:
    """Runs steps until `total_steps` is reached or `stop` is set (checked between steps)."""

    def __init__(
        self,
        config: TrainerConfig,
        session_factory: SessionFactory,
        policy: PolicyHandle,
        clients: Sequence[SGLangClient],
        checkpoint_dir: Path,
        monitor: Monitor,
    ) -> None:
        self._config = config
        self._db = session_factory
        self._policy = policy
        self._clients = list(clients)
        self._checkpoint_dir = checkpoint_dir
        self._monitor = monitor

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Train until done or stopped; returns the last recorded policy version."""
        config = self._config
        version = await self.resume()
        while not (stop is not None and stop.is_set()) and not self._done(version):
            batch = await claim_batch(
                self._db,
                config.batch_size,
                version,
                config.max_head_offpolicyness,
                lease_s=config.claim_lease_s,
            )
            if not batch.samples:
                await _sleep(config.poll_interval_s, stop)
                continue
            version = await self._step(batch, version)
        return version

    async def resume(self) -> int:
        """The last recorded version; its checkpoint goes into the actor and to any worker serving
        something else (a worker restarted, or one that loaded a step that was never recorded)."""
        version = await latest_policy_version(self._db) or 0
        if version > 0:
            path = await _checkpoint_path(self._db, version)
            await self._policy.load(path)
        else:
            path = await self._policy.model_dir()
        await self._sync_workers(path, version)
        logger.info("trainer at policy version %d (%s)", version, path)
        return version

    async def _step(self, batch: ClaimedBatch, version: int) -> int:
        new_version = version + 1
        started = time.perf_counter()
        try:
            stats = await self._policy.train_step(batch.samples, version)
            saved = time.perf_counter()
            path = await self._policy.save(str(self._checkpoint_dir), new_version)
            stats["perf/save_s"] = time.perf_counter() - saved
            stats["perf/push_s"] = await push_weights(self._clients, path, new_version, self._config.weights)
            stats["perf/weight_sync_s"] = stats["perf/save_s"] + stats["perf/push_s"]
            stats["perf/step_s"] = time.perf_counter() - started
            metrics = finite_metrics(stats)
            record = StepRecord(
                step=new_version, policy_version=new_version, checkpoint_path=path, metrics=metrics
            )
            await record_step(self._db, record, batch.claim_token, batch.ids)
        except BaseException:
            released = await release_claim(self._db, batch.claim_token)
            logger.exception(
                "step %d failed after claiming %d trajectories; released %d",
                new_version,
                len(batch),
                released,
            )
            raise
        self._monitor.record(new_version, new_version, metrics)
        prune_checkpoints(self._checkpoint_dir, self._config.keep_checkpoints, protect=new_version)
        return new_version

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
            await push_weights(behind, path, version, self._config.weights)

    def _done(self, version: int) -> bool:
        return self._config.total_steps is not None and version >= self._config.total_steps


async def _checkpoint_path(session_factory: SessionFactory, version: int) -> str:
    async with session_factory() as db:
        path = await db.scalar(select(PolicyVersion.checkpoint_path).where(PolicyVersion.version == version))
    if path is None:
        raise LookupError(f"policy version {version} has no row in policy_versions")
    return path


async def _sleep(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep, waking early when `stop` is set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
