"""The driver loop on real SQLite and Postgres with scripted workers and a stand-in policy: steps recorded
with their ids, failures after the claim give it back, a restart resumes and re-syncs the workers,
and weight pushes reach every worker (or say which one refused)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select

from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.claims import claim_batch
from storage.engine import SessionFactory
from storage.models import PolicyVersion, TrainStep, Trajectory
from tests.support.scripted_worker import ScriptedWorker
from tests.support.trainer_driver import FakePolicy, groups
from trainer.config import TrainerConfig, WeightPushConfig
from trainer.driver import Driver
from trainer.monitor import Monitor
from trainer.weights.disk import WeightPushError, push_weights


@pytest.fixture
async def workers() -> AsyncIterator[list[ScriptedWorker]]:
    async with ScriptedWorker() as first, ScriptedWorker() as second:
        yield [first, second]


def _driver(
    config: TrainerConfig,
    session_factory: SessionFactory,
    policy: FakePolicy,
    pool: WorkerPool,
    tmp_path: Path,
) -> Driver:
    return Driver(
        config, session_factory, policy, pool.clients, tmp_path / "ckpt", Monitor(tmp_path / "m.jsonl")
    )


async def _rows(
    session_factory: SessionFactory,
) -> tuple[dict[int, tuple[int | None, str | None]], list[int]]:
    async with session_factory() as db:
        trajectories = {
            t.id: (t.consumed_step, t.claim_token) for t in (await db.scalars(select(Trajectory)))
        }
        versions = sorted((await db.scalars(select(PolicyVersion.version))).all())
    return trajectories, versions


async def test_each_step_pushes_then_records_its_ids(
    session_factory: SessionFactory, workers: list[ScriptedWorker], tmp_path: Path
) -> None:
    ids = await groups(session_factory, count=3)
    config = TrainerConfig(batch_size=2, max_head_offpolicyness=5, total_steps=3, poll_interval_s=0.01)
    policy = FakePolicy()
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        assert await _driver(config, session_factory, policy, pool, tmp_path).run() == 3
    trajectories, versions = await _rows(session_factory)
    assert versions == [1, 2, 3]
    assert [v for _, v in policy.trained] == [0, 1, 2]
    for step, (trained, _) in enumerate(policy.trained, start=1):
        assert all(trajectories[i] == (step, trajectories[i][1]) for i in trained)
    assert sorted(i for batch, _ in policy.trained for i in batch) == ids
    for worker in workers:
        pushed = [r.body for r in worker.requests_to("/update_weights_from_disk")]
        assert [b["weight_version"] for b in pushed] == ["1", "2", "3"]
        assert pushed[-1]["model_path"] == str(tmp_path / "ckpt" / "v000003")
        assert worker.weight_version == "3"
    async with session_factory() as db:
        metrics = (await db.scalars(select(TrainStep.metrics).order_by(TrainStep.step))).all()
    assert metrics[0]["loss"] == 0.5 and metrics[0]["perf/push_s"] >= 0 and "perf/weight_sync_s" in metrics[0]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("failure", ["train", "push"])
async def test_a_failure_after_the_claim_releases_it(
    session_factory: SessionFactory, workers: list[ScriptedWorker], tmp_path: Path, failure: str
) -> None:
    ids = await groups(session_factory, count=2)
    policy = FakePolicy(fail_train=failure == "train")
    if failure == "push":
        workers[1].weight_load_error = "No space left on device"
    config = TrainerConfig(batch_size=4, total_steps=1, poll_interval_s=0.01)
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        expected = RuntimeError if failure == "train" else WeightPushError
        with pytest.raises(expected) as raised:
            await _driver(config, session_factory, policy, pool, tmp_path).run()
    if failure == "push":
        assert workers[1].url in str(raised.value) and "No space left on device" in str(raised.value)
    trajectories, versions = await _rows(session_factory)
    assert versions == []  # nothing recorded
    assert all(trajectories[i] == (None, None) for i in ids)  # unconsumed and unclaimed
    again = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)
    assert sorted(again.ids) == ids  # a new claim gets every sample back


async def test_a_restart_resumes_at_the_recorded_version_and_resyncs_workers(
    session_factory: SessionFactory, workers: list[ScriptedWorker], tmp_path: Path
) -> None:
    await groups(session_factory, count=2)
    config = TrainerConfig(batch_size=2, max_head_offpolicyness=5, total_steps=2, poll_interval_s=0.01)
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        await _driver(config, session_factory, FakePolicy(), pool, tmp_path).run()
        workers[0].weight_version = "default"  # worker 0 restarted; worker 1 still serves version 2
        workers[0].requests.clear()
        workers[1].requests.clear()
        restarted = FakePolicy()
        later = config.model_copy(update={"total_steps": 3})
        await groups(session_factory, count=1, version=2)
        assert await _driver(later, session_factory, restarted, pool, tmp_path).run() == 3
    assert restarted.loaded == [str(tmp_path / "ckpt" / "v000002")]
    assert restarted.trained[0][1] == 2
    first_push = workers[0].requests_to("/update_weights_from_disk")[0].body
    assert first_push["weight_version"] == "2" and first_push["model_path"].endswith("v000002")
    assert [r.body["weight_version"] for r in workers[1].requests_to("/update_weights_from_disk")] == ["3"]


async def test_stop_ends_the_loop_between_steps(
    session_factory: SessionFactory, workers: list[ScriptedWorker], tmp_path: Path
) -> None:
    stop = asyncio.Event()
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        run = asyncio.create_task(
            _driver(TrainerConfig(poll_interval_s=30), session_factory, FakePolicy(), pool, tmp_path).run(
                stop
            )
        )
        await asyncio.sleep(0.2)  # polling an empty table
        stop.set()
        assert await asyncio.wait_for(run, timeout=5) == 0


async def test_push_pauses_in_place_and_always_continues(workers: list[ScriptedWorker]) -> None:
    workers[0].weight_load_error = "bad checkpoint"
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        with pytest.raises(WeightPushError, match="bad checkpoint"):
            await push_weights(pool.clients, "/ckpt/v000004", 4, WeightPushConfig(pause_mode="in_place"))
    for worker in workers:
        paths = [r.path for r in worker.requests if r.path != "/model_info"]
        assert paths == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert worker.requests_to("/pause_generation")[0].body == {"mode": "in_place"}
    assert workers[1].weight_version == "4" and workers[0].weight_version == "default"


async def test_push_without_pause_only_updates(workers: list[ScriptedWorker]) -> None:
    async with WorkerPool(ClientConfig(), [w.url for w in workers]) as pool:
        assert await push_weights(pool.clients, "/ckpt/v000001", 1, WeightPushConfig(pause_mode=None)) >= 0
    for worker in workers:
        assert [r.path for r in worker.requests] == ["/update_weights_from_disk"]
        assert worker.requests[0].body == {
            "model_path": "/ckpt/v000001",
            "weight_version": "1",
            "flush_cache": True,
            "abort_all_requests": False,
        }
