"""A stand-in policy and sample groups for tests of the trainer's driver loop (no model, no Ray)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from storage.engine import SessionFactory
from storage.queries import create_group, insert_trajectories
from storage.records import GroupRecord, SessionRecord, TrainingSample, TrajectoryRecord
from tests.support.databases import key_hash

_ids = itertools.count()


class FakePolicy:
    """Records what the driver asks; `fail_train` makes train_step raise after the claim."""

    def __init__(self, fail_train: bool = False) -> None:
        self.fail_train = fail_train
        self.trained: list[tuple[list[int], int]] = []
        self.loaded: list[str] = []

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        if self.fail_train:
            raise RuntimeError("injected failure after the claim")
        self.trained.append(([s.trajectory_id for s in samples], current_version))
        return {"reward/mean": float(np.mean([s.reward for s in samples])), "loss": 0.5}

    async def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str:
        path = Path(checkpoint_dir) / f"v{version:06d}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    async def load(self, checkpoint_path: str) -> None:
        self.loaded.append(checkpoint_path)

    async def model_dir(self) -> str:
        return "/models/base"


async def groups(session_factory: SessionFactory, count: int, size: int = 2, version: int = 0) -> list[int]:
    ids: list[int] = []
    for _ in range(count):
        gid = f"g{next(_ids)}"
        sessions = [
            SessionRecord(id=f"{gid}-{i}", key_hash=key_hash(f"{gid}-{i}"), group_id=gid)
            for i in range(size)
        ]
        await create_group(session_factory, GroupRecord(id=gid, size=size), sessions)
        for i, session in enumerate(sessions):
            ids += await insert_trajectories(
                session_factory,
                session.id,
                [
                    TrajectoryRecord(
                        token_ids=[1, 2, 3],
                        loss_mask=[False, True, True],
                        logprobs=[0.0, -1.0, -1.0],
                        versions=[-1, version, version],
                        reward=float(i),
                    )
                ],
            )
    return ids
