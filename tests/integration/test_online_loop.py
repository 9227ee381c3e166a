"""Online training end to end with the tiny model: simulated users chat on online keys and send feedback
late and out of order; the trainer steps on every few rewarded samples; every new version is evaluated on
a held-out set on an eval worker of its own before the serving worker gets it. After versions have been
promoted, one update is damaged on purpose (every weight zeroed): it must be rejected and never served,
and training must go on from the best version."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import select

from rewards.config import FinalizerConfig, RewardsConfig
from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.engine import SessionFactory
from storage.models import Completion, Feedback, PolicyVersion, Session, TrainStep, VersionStatus
from tests.support.feedback import new_online_key
from tests.support.online_loop import (
    LocalPolicy,
    SimulatedUsers,
    gated_driver,
    online_trainer_config,
    two_engines,
)
from tests.support.proxy_harness import ProxyFactory
from trainer.checkpoint import list_checkpoints

pytestmark = [pytest.mark.slow]

USERS = 3
LEARNED = 0.15  # the best eval score reached before the damaged update (a zeroed model scores 0)
LEARN_DEADLINE_S = 420.0


@pytest.fixture
def engines(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    with two_engines(tiny_model_dir) as urls:
        yield urls


async def _versions(session_factory: SessionFactory) -> list[PolicyVersion]:
    async with session_factory() as db:
        return list((await db.scalars(select(PolicyVersion).order_by(PolicyVersion.version))).all())


async def _wait_for(
    session_factory: SessionFactory, what: str, done, deadline_s: float
) -> list[PolicyVersion]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        versions = await _versions(session_factory)
        if done(versions):
            return versions
        await asyncio.sleep(1.0)
    described = [
        (v.version, v.status, v.eval_score, v.parent_version) for v in await _versions(session_factory)
    ]
    raise AssertionError(f"{what} did not happen within {deadline_s:.0f} s: {described}")


def _best_before(versions: list[PolicyVersion], version: int) -> PolicyVersion:
    promoted = [v for v in versions if v.status == VersionStatus.PROMOTED.value and v.version < version]
    return max(promoted, key=lambda v: (v.eval_score if v.eval_score is not None else -1.0, v.version))


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the loop is not about the database
async def test_online_loop_promotes_learning_and_never_serves_a_damaged_update(
    proxies: ProxyFactory,
    engines: tuple[str, str],
    db_url: str,
    session_factory: SessionFactory,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    serving_url, eval_url = engines
    finalizer = FinalizerConfig(reward_grace_s=4.0, session_ttl_s=30.0, sweep_interval_s=0.5)
    proxy = proxies.start([serving_url], rewards=RewardsConfig(), finalizer=finalizer)
    keys = [new_online_key(proxy) for _ in range(USERS)]
    config = online_trainer_config(batch_size=4, margin=0.02)
    policy = LocalPolicy(tiny_model_dir, config)
    users = SimulatedUsers(proxy.base_url, keys)
    stop_users, stop_trainer = asyncio.Event(), asyncio.Event()
    async with gated_driver(
        config, session_factory, policy, serving_url, eval_url, tiny_model_dir, tmp_path
    ) as driver:
        training = asyncio.create_task(driver.run(stop_trainer))
        traffic = asyncio.create_task(users.run(stop_users))
        try:
            learned = await _wait_for(
                session_factory,
                "two promotions and a learned eval score",
                lambda vs: (
                    sum(v.status == "promoted" and v.version > 0 for v in vs) >= 2
                    and max((v.eval_score or 0.0) for v in vs if v.status == "promoted") >= LEARNED
                ),
                LEARN_DEADLINE_S,
            )
            policy.damage_next_step()
            damaged_from = learned[-1].version
            # The damaged step is the first to start after this: among the next two versions.
            await _wait_for(
                session_factory,
                "the damaged version and the ones after it settled",
                lambda vs: len([v for v in vs if v.version > damaged_from and v.status != "candidate"]) >= 3,
                180.0,
            )
        finally:
            stop_users.set()
            stats = await asyncio.wait_for(traffic, 120)
            stop_trainer.set()
            await asyncio.wait_for(training, 300)
    async with WorkerPool(ClientConfig(), [serving_url]) as pool:
        info = await pool.clients[0].model_info()
    after = await _versions(session_factory)  # the trainer may have gone on while the users stopped

    async with session_factory() as db:
        steps = (await db.scalars(select(TrainStep))).all()
    damaged_steps = [step.policy_version for step in steps if step.metrics.get("damaged")]
    assert len(damaged_steps) == 1
    damaged = next(v for v in after if v.version == damaged_steps[0])
    assert damaged.status == "rejected"
    assert damaged.eval_score is not None and damaged.eval_score < LEARNED
    assert "below the best version" in (damaged.reason or "")
    assert damaged.served_at is None
    best = _best_before(after, damaged.version)
    following = [v for v in after if v.version > damaged.version]
    assert following and following[0].parent_version == best.version  # trained on from the best version
    promoted = {v.version for v in after if v.status == "promoted"}
    assert len(promoted - {0}) >= 2

    # Per token: every generated token of every completion carries a promoted version.
    async with session_factory() as db:
        completions = (await db.scalars(select(Completion))).all()
    versions = np.concatenate([np.asarray(c.output_versions) for c in completions])
    assert set(np.unique(versions[versions >= 0]).tolist()) <= promoted
    assert int(damaged.version) not in set(versions.tolist())
    assert info["weight_version"] in {str(v) for v in promoted} | {"default"}

    assert stats.turns > 0 and stats.feedback["applied"] > 0, stats
    # Feedback came late (after its conversation had ended) and out of order (not in answer order).
    async with session_factory() as db:
        rows = (
            await db.execute(
                select(Feedback.created_at, Session.ended_at, Completion.created_at)
                .join(Session, Session.id == Feedback.session_id)
                .join(Completion, Completion.id == Feedback.completion_id)
                .order_by(Feedback.id)
            )
        ).all()
    assert any(ended is not None and given > ended for given, ended, _ in rows)
    answered = [answered_at for _, _, answered_at in rows]
    assert answered != sorted(answered)
    assert not [e for e in stats.errors if not e.startswith("feedback 4")], stats.errors
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        policy_view = (await http.get("/rl/v1/policy", headers={"Authorization": f"Bearer {keys[0]}"})).json()
    assert policy_view["policy_version"] in promoted
    assert policy_view["newest"]["version"] >= after[-1].version

    # Retention (keep_checkpoints=2) never dropped the served or the best version.
    kept = set(list_checkpoints(tmp_path / "ckpt"))
    served = max((v for v in after if v.served_at is not None), key=lambda v: v.served_at)
    assert {served.version, _best_before(after, after[-1].version + 1).version} - {0} <= kept
