"""Eval-gated promotion in the driver loop, on real SQLite and Postgres with scripted workers and a
stand-in policy: a gate that answers scores given by the test decides what is served. Promoted versions
are pushed and recorded served; a rejected one is never pushed, the actor goes back to the best version,
serving rolls back to it, and the next version descends from it; a restart settles a candidate left
unevaluated before it trains; the served, best and evaluated checkpoints survive pruning. The real
evaluator on a real engine is tests/integration/test_online_loop.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select, update

from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.engine import SessionFactory, write_transaction
from storage.models import PolicyVersion
from storage.policy_versions import best_version, protected_versions, served_version, settle
from storage.records import EvalResult
from tests.support.scripted_worker import ScriptedWorker
from tests.support.trainer_driver import FakePolicy, groups
from trainer.checkpoint import list_checkpoints
from trainer.config import PromotionConfig, TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor


class ScoreGate:
    """Answers each version's score from `scores` (by version), one item per score; records the calls."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores
        self.evaluated: list[tuple[str, int]] = []

    async def evaluate(self, checkpoint_path: str, version: int) -> EvalResult:
        self.evaluated.append((checkpoint_path, version))
        score = self.scores[version]
        return EvalResult(score=score, item_scores={"a": score}, details={"worker": "scripted"})


@pytest.fixture
async def worker() -> AsyncIterator[ScriptedWorker]:
    async with ScriptedWorker() as running:
        yield running


def _gated(total_steps: int, margin: float = 0.0) -> TrainerConfig:
    return TrainerConfig(
        batch_size=2,
        max_head_offpolicyness=10,
        total_steps=total_steps,
        poll_interval_s=0.01,
        keep_checkpoints=1,
        promotion=PromotionConfig(enabled=True, margin=margin),
    )


async def _run(
    config: TrainerConfig,
    session_factory: SessionFactory,
    policy: FakePolicy,
    gate: ScoreGate,
    worker: ScriptedWorker,
    tmp_path: Path,
) -> int:
    async with WorkerPool(ClientConfig(), [worker.url]) as pool:
        driver = Driver(
            config,
            session_factory,
            policy,
            pool.clients,
            tmp_path / "ckpt",
            Monitor(tmp_path / "m.jsonl"),
            gate=gate,
        )
        return await driver.run()


async def _rows(session_factory: SessionFactory) -> dict[int, PolicyVersion]:
    async with session_factory() as db:
        return {v.version: v for v in (await db.scalars(select(PolicyVersion)))}


def _pushed(worker: ScriptedWorker) -> list[str]:
    return [r.body["weight_version"] for r in worker.requests_to("/update_weights_from_disk")]


async def test_rejected_versions_are_never_served_and_training_goes_on_from_the_best(
    session_factory: SessionFactory, worker: ScriptedWorker, tmp_path: Path
) -> None:
    await groups(session_factory, count=4)
    # v0 0.5 (the initial weights); v1 0.45 is promoted within the margin and served; v2 0.1 is rejected:
    # serving rolls back to v0, the best; v3 trains from v0 and is promoted.
    gate = ScoreGate({0: 0.5, 1: 0.45, 2: 0.1, 3: 0.6})
    policy = FakePolicy()
    assert await _run(_gated(3, margin=0.1), session_factory, policy, gate, worker, tmp_path) == 3
    rows = await _rows(session_factory)
    assert {v: r.status for v, r in rows.items()} == {
        0: "promoted",
        1: "promoted",
        2: "rejected",
        3: "promoted",
    }
    assert [rows[v].parent_version for v in (1, 2, 3)] == [0, 1, 0]
    assert "below the best version's 0.5000" in (rows[2].reason or "")
    assert rows[2].served_at is None and rows[2].eval_score == pytest.approx(0.1)
    assert rows[3].eval_details is not None and rows[3].eval_details["items"] == {"a": 0.6}
    assert {"eval_s", "push_s"} <= set(rows[3].eval_details)
    assert [v for _, v in gate.evaluated] == [0, 1, 2, 3]
    assert "2" not in _pushed(worker)  # never served
    assert _pushed(worker) == ["1", "default", "3"]  # v1, the rollback to v0, v3
    assert worker.requests_to("/update_weights_from_disk")[1].body["model_path"] == "/models/base"
    assert policy.loaded == ["/models/base"]  # the actor went back to v0 after the rejection
    assert [current for _, current in policy.trained] == [0, 1, 0]  # v3 trained from v0, not v2
    assert (await served_version(session_factory)).version == 3  # type: ignore[union-attr]
    assert (await best_version(session_factory)).version == 3  # type: ignore[union-attr]


async def test_a_restart_settles_a_candidate_left_unevaluated_before_training(
    session_factory: SessionFactory, worker: ScriptedWorker, tmp_path: Path
) -> None:
    await groups(session_factory, count=1)
    gate = ScoreGate({0: 0.5, 1: 0.7})
    assert await _run(_gated(1), session_factory, FakePolicy(), gate, worker, tmp_path) == 1
    # As if the trainer had stopped between recording v1 and its verdict:
    async with write_transaction(session_factory) as db:
        await db.execute(
            update(PolicyVersion)
            .where(PolicyVersion.version == 1)
            .values(status="candidate", served_at=None, eval_score=None, eval_details=None)
        )
    worker.weight_version = "default"
    again = ScoreGate({1: 0.2})
    policy = FakePolicy()
    assert await _run(_gated(1), session_factory, policy, again, worker, tmp_path) == 0
    assert [v for _, v in again.evaluated] == [1]  # v0 was scored already; v1 is settled now
    assert (await _rows(session_factory))[1].status == "rejected"
    assert worker.weight_version == "default"


async def test_gating_starts_by_scoring_the_initial_weights_once(
    session_factory: SessionFactory, worker: ScriptedWorker, tmp_path: Path
) -> None:
    gate = ScoreGate({0: 0.25})
    async with WorkerPool(ClientConfig(), [worker.url]) as pool:
        driver = Driver(
            _gated(1),
            session_factory,
            FakePolicy(),
            pool.clients,
            tmp_path / "ckpt",
            Monitor(tmp_path / "m.jsonl"),
            gate=gate,
        )
        assert await driver.resume() == 0
        assert await driver.resume() == 0
    initial = (await _rows(session_factory))[0]
    assert initial.status == "promoted" and initial.eval_score == 0.25 and initial.served_at is not None
    assert gate.evaluated == [("/models/base", 0)]


async def test_pruning_keeps_the_served_the_best_and_candidates(
    session_factory: SessionFactory, worker: ScriptedWorker, tmp_path: Path
) -> None:
    await groups(session_factory, count=4)
    # v1 is best (0.9); v2 is promoted within the margin and served; v3 and v4 are rejected.
    gate = ScoreGate({0: 0.1, 1: 0.9, 2: 0.85, 3: 0.0, 4: 0.0})
    await _run(_gated(4, margin=0.1), session_factory, FakePolicy(), gate, worker, tmp_path)
    assert {v: r.status for v, r in (await _rows(session_factory)).items()} == {
        0: "promoted",
        1: "promoted",
        2: "promoted",
        3: "rejected",
        4: "rejected",
    }
    # keep_checkpoints=1 keeps the newest (v4); v1 (best, served again after the rollback) stays too.
    assert await protected_versions(session_factory) == {1}
    assert set(list_checkpoints(tmp_path / "ckpt")) == {1, 4}


async def test_a_verdict_is_given_once(
    session_factory: SessionFactory, worker: ScriptedWorker, tmp_path: Path
) -> None:
    await groups(session_factory, count=1)
    await _run(_gated(1), session_factory, FakePolicy(), ScoreGate({0: 0.0, 1: 0.0}), worker, tmp_path)
    with pytest.raises(ValueError, match="not a candidate"):
        await settle(session_factory, 1, promoted=False, result=None, reason="again")
