"""Helpers of the Scaffolding integration tests: a GSM8K-format JSONL fixture, what the RL API says of a
run's sessions, and one trainer step (the real driver, a stand-in policy that keeps the samples it was
given) over what the run left in the database."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

from integrations.gsm8k.problems import Problem
from integrations.gsm8k.rl_api import RLClient
from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.engine import SessionFactory
from storage.models import Trajectory
from storage.records import TrainingSample
from tests.support.proxy_harness import Proxy, run_db
from tests.support.trainer_driver import FakePolicy
from trainer.config import TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor


def write_gsm8k_jsonl(path: Path, problems: Iterable[Problem]) -> Path:
    """GSM8K's own rows: the question, and the worked solution ending in `#### N`."""
    rows = [{"question": p.question, "answer": p.solution} for p in problems]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def session_views(proxy: Proxy, session_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """GET /rl/v1/sessions/{id} of each session, with the admin key."""
    with RLClient(proxy.base_url, proxy.admin_key) as rl:
        return {session_id: rl.session(session_id) for session_id in session_ids}


def wait_finalized(proxy: Proxy, session_ids: Sequence[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = {v["status"] for v in session_views(proxy, session_ids).values()}
        if states == {"finalized"}:
            return
        assert time.monotonic() < deadline, f"sessions not finalized in {timeout_s} s: {states}"
        time.sleep(0.2)


class KeepingPolicy(FakePolicy):
    """The driver's stand-in policy, keeping every sample it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[TrainingSample] = []

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        self.samples.extend(samples)
        return await super().train_step(samples, current_version)


async def _trajectories(session_factory: SessionFactory) -> dict[int, tuple[str, int | None]]:
    async with session_factory() as db:
        rows = await db.execute(select(Trajectory.id, Trajectory.session_id, Trajectory.consumed_step))
        return {row.id: (row.session_id, row.consumed_step) for row in rows}


def trajectories(db_url: str) -> dict[int, tuple[str, int | None]]:
    """Every trajectory: its id → (session id, the step that consumed it)."""
    return run_db(db_url, _trajectories)


def train_one_step(
    db_url: str, worker_url: str, batch_size: int, run_dir: Path
) -> tuple[int, list[TrainingSample]]:
    """One driver step on the database (weights pushed to the worker at `worker_url`): the version it
    recorded, and the samples it claimed."""
    policy = KeepingPolicy()
    config = TrainerConfig(batch_size=batch_size, max_head_offpolicyness=5, total_steps=1,
                           poll_interval_s=0.05)

    async def step(session_factory: SessionFactory) -> int:
        async with WorkerPool(ClientConfig(), [worker_url]) as pool:
            driver = Driver(config, session_factory, policy, pool.clients, run_dir / "ckpt",
                            Monitor(run_dir / "metrics.jsonl"))
            return await asyncio.wait_for(driver.run(), timeout=60)

    return run_db(db_url, step), policy.samples
