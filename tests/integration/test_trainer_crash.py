"""`kill -9` the trainer anywhere in a step and restart it: no sample is trained twice or lost, versions
go on without a gap, every worker serves the recorded version, and the run ends with the weights an
uninterrupted run over the same samples has (the optimiser state, baselines and generators came back).

The real `flywheel trainer` runs as a subprocess with a Ray instance of its own, against two CPU engines,
each behind a proxy that can hold a control call back so the test knows where the trainer is. It is
killed (a) in a train step, (b) in a weight push, (c) after a push, before its record (blocked by a
Postgres table lock the test holds), then restarted to finish. The samples are inserted directly, so
that the reference run (the policy in this process, one step per batch of claims in id order) sees the
same. Every trainer start pays for a Ray instance; the claims and resume logic on SQLite are covered by
the quick test at the end, with a stand-in policy.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.claims import claim_batch
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import PolicyVersion, TrainStep, Trajectory
from storage.records import TrainingSample
from tests.support.databases import storage_overrides
from tests.support.engine_server import running_engine
from tests.support.proxy_harness import LoopThread
from tests.support.scripted_worker import ScriptedWorker
from tests.support.trainer_crash import (
    HoldingProxy,
    RecordLock,
    insert_fixed_groups,
    kill_trainer,
    reference_run,
    start_trainer,
    trainer_processes,
    wait_until,
)
from tests.support.trainer_driver import FakePolicy, groups
from trainer.checkpoint import TRAINER_STATE, checkpoint_name, remember_claim
from trainer.config import TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor

STEPS = 4
BATCH = 4  # two groups of two
LENGTH = 96  # tokens per trajectory: a train step takes long enough to be caught in it
TOLERANCE = 1e-6
"""Largest weight difference allowed against the uninterrupted reference: on CPU in fp32 with one thread
the resumed steps run the same kernels on the same inputs, and agree bit for bit (0)."""

TRAINER = {
    "total_steps": STEPS,
    "batch_size": BATCH,
    "lr": 1e-3,
    "ppo_epochs": 2,
    "minibatches": 2,  # the shuffle generator decides the minibatches
    "max_head_offpolicyness": STEPS,  # every sample is of version 0
    "num_threads": 1,
    "poll_interval_s": 0.05,
    "keep_checkpoints": 2,
    "worker_wait_s": 60,
}


class Run:
    """One crash run: the database, two CPU engines each behind a `HoldingProxy`, and the trainer
    processes started (each with a Ray temp dir of its own), all killed and removed by `close`."""

    def __init__(
        self, db_url: str, servers: LoopThread, engines: list[str], model_dir: Path, tmp_path: Path
    ) -> None:
        self.db_url = db_url
        self.servers = servers
        self.engines = engines
        self.model_dir = model_dir
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "trainer.log"
        self.trainers: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.proxies = [HoldingProxy(url) for url in engines]
        for proxy in self.proxies:
            servers.call(proxy.start())
        self._engine = servers.call(_open(db_url))
        self.db: SessionFactory = create_sessionmaker(self._engine)

    @property
    def trainer(self) -> subprocess.Popen[bytes]:
        return self.trainers[-1][0]

    def start(self) -> None:
        ray_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # Unix socket paths must stay short
        overrides = [
            *storage_overrides(self.db_url),
            f"serving.model={self.model_dir}",
            f"serving.worker_urls={json.dumps([p.url for p in self.proxies])}",
            f"run.dir={self.run_dir}",
            *(f"trainer.{key}={value}" for key, value in TRAINER.items()),
            f"trainer.ray.temp_dir={ray_dir}",
            "trainer.ray.num_cpus=1",
        ]
        self.trainers.append((start_trainer(overrides, self.log), ray_dir))

    def kill(self) -> None:
        kill_trainer(*self.trainers[-1])

    def leftovers(self) -> list[int]:
        """Live processes of any trainer this run started (Ray's included)."""
        return [pid for process, ray_dir in self.trainers for pid in trainer_processes(process.pid, ray_dir)]

    def query(self, query: Any) -> list[Any]:
        async def run() -> list[Any]:
            async with self.db() as db:
                return list((await db.scalars(query)).all())

        return self.servers.call(run())

    def claimed(self) -> list[int]:
        """Trajectories held by a claim and not consumed."""
        held = Trajectory.claim_token.is_not(None) & Trajectory.consumed_step.is_(None)
        return sorted(self.query(select(Trajectory.id).where(held)))

    def versions(self) -> list[int]:
        return self.query(select(PolicyVersion.version).order_by(PolicyVersion.version))

    def served(self) -> list[str]:
        """Each engine's `weight_version` (asked directly, not through its proxy)."""
        infos = [httpx.get(f"{url}/model_info", timeout=30).json() for url in self.engines]
        return [str(info["weight_version"]) for info in infos]

    def paused(self, engine: str) -> bool:
        return bool(httpx.get(f"{engine}/server_info", timeout=30).json()["internal_states"][0]["paused"])

    def close(self) -> None:
        for process, ray_dir in self.trainers:
            kill_trainer(process, ray_dir)
            shutil.rmtree(ray_dir, ignore_errors=True)
        for proxy in self.proxies:
            self.servers.call(proxy.stop())
        self.servers.call(self._engine.dispose())


async def _open(db_url: str) -> AsyncEngine:
    return create_engine(StorageConfig(url=db_url))


POSTGRES_ONLY = pytest.param("postgres", marks=pytest.mark.postgres)


@pytest.mark.slow
@pytest.mark.parametrize("empty_db_url", [POSTGRES_ONLY], indirect=True)
def test_kill_9_anywhere_in_a_step_loses_nothing_and_resumes_exactly(
    db_url: str, servers: LoopThread, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        engines = [stack.enter_context(running_engine(tiny_model_dir)) for _ in range(2)]
        run = Run(db_url, servers, engines, tiny_model_dir, tmp_path)
        stack.callback(run.close)
        stack.callback(lambda: print(run.log.read_text(errors="replace")[-8000:] if run.log.exists() else ""))
        inserted = servers.call(insert_fixed_groups(run.db, groups=2 * STEPS, size=2, length=LENGTH))
        batches = [inserted[2 * s] + inserted[2 * s + 1] for s in range(STEPS)]
        checkpoints = run.run_dir / "checkpoints"

        # (a) In step 1's train step: killed as soon as its samples are claimed, before any push.
        run.start()
        claimed = wait_until(run.claimed, 180, "step 1 to claim its samples", poll_s=0.01)
        run.kill()
        assert claimed == _ids(batches[0])
        assert not any("/pause_generation" in p.paths_since(0) for p in run.proxies), "killed after the push"
        assert run.versions() == [] and run.claimed() == _ids(batches[0])

        # (b) In step 2's push: worker 0 is paused and never gets the update; worker 1 may have loaded it.
        held = run.proxies[0].hold("/update_weights_from_disk", "2")
        run.start()
        wait_until(held.arrived.is_set, 180, "step 2's push")
        run.kill()
        held.forward = False
        held.release.set()
        assert run.versions() == [1] and run.claimed() == _ids(batches[1])
        assert run.paused(engines[0]) and run.served()[0] == "1"
        after_b = len(run.proxies[0].seen)

        # (c) After step 3's push, before its record, which waits for the lock the test holds.
        held = run.proxies[0].hold("/update_weights_from_disk", "3")
        lock = RecordLock(db_url, servers.loop)
        run.start()
        wait_until(held.arrived.is_set, 180, "step 3's push")
        lock.take()
        try:
            held.release.set()
            wait_until(lock.record_is_waiting, 60, "step 3's record to wait for the lock")
            run.kill()
        finally:
            lock.release()
        assert run.served() == ["3", "3"]  # the workers got a version that was never recorded
        assert run.versions() == [1, 2] and run.claimed() == _ids(batches[2])
        # The restart after (b) let the worker it found paused continue before pushing anything to it.
        paths = run.proxies[0].paths_since(after_b)
        assert paths.index("/continue_generation") < paths.index("/pause_generation")

        # Restarted once more, the trainer finishes the run and leaves no process behind.
        run.start()
        assert run.trainer.wait(300) == 0
        wait_until(lambda: not run.leftovers(), 60, "the trainer's Ray processes to stop", poll_s=0.2)
        assert run.served() == ["4", "4"]  # every worker serves the recorded version

    # Every sample trained exactly once, in the step an uninterrupted run trains it; no version skipped.
    assert run.versions() == list(range(1, STEPS + 1))
    assert run.query(select(TrainStep.step).order_by(TrainStep.step)) == list(range(1, STEPS + 1))
    rows = run.query(select(Trajectory))
    by_step = {step: sorted(t.id for t in rows if t.consumed_step == step) for step in range(1, STEPS + 1)}
    assert by_step == {step + 1: _ids(batch) for step, batch in enumerate(batches)}
    assert all(t.consumed_step is not None for t in rows)
    # The weights are an uninterrupted run's over the same batches.
    expected = reference_run(tiny_model_dir, TrainerConfig.model_validate(TRAINER), batches)
    final = load_file(checkpoints / checkpoint_name(STEPS) / "model.safetensors")
    assert max(float((final[name] - expected[name]).abs().max()) for name in final) <= TOLERANCE
    # Retention: the newest two checkpoints, the trainer state only in the newest.
    assert sorted(p.name for p in checkpoints.glob("v*")) == ["v000003", "v000004"]
    assert (checkpoints / "v000004" / TRAINER_STATE).is_file()
    assert not (checkpoints / "v000003" / TRAINER_STATE).exists()


def _ids(batch: list[TrainingSample]) -> list[int]:
    return sorted(sample.trajectory_id for sample in batch)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
async def test_resume_gives_back_a_dead_steps_claim_and_continues_paused_workers(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    """What a step that died leaves behind, undone at the restart: its claim (held for `claim_lease_s`
    otherwise), a checkpoint of its unrecorded version, a worker its push left paused."""
    ids = await groups(session_factory, count=2)
    dead = await claim_batch(session_factory, 2, 0, 0)
    assert sorted(dead.ids) == ids[:2]
    remember_claim(tmp_path / "ckpt", dead.claim_token)
    leftover = tmp_path / "ckpt" / checkpoint_name(1)
    leftover.mkdir()
    (leftover / "half-written").write_text("")
    config = TrainerConfig(batch_size=2, total_steps=1, poll_interval_s=0.01)
    async with ScriptedWorker() as first, ScriptedWorker() as second:
        async with WorkerPool(ClientConfig(), [first.url, second.url]) as pool:
            await pool.clients[0].pause_generation("abort")
            policy = FakePolicy()
            driver = Driver(
                config, session_factory, policy, pool.clients, tmp_path / "ckpt", Monitor(tmp_path / "m")
            )
            await asyncio.wait_for(driver.run(), 30)
        paths = [r.path for r in first.requests]
    assert policy.trained == [(ids[:2], 0)]  # the dead step's samples, at once
    assert not (leftover / "half-written").exists()
    assert paths.index("/continue_generation") < paths.index("/update_weights_from_disk")
