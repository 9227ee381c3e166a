"""Samples and steps for the admission-control and stale-sample tests: online sessions' and RL API
sessions' trajectories at chosen policy versions, a training step recorded by hand, and readers of the
trajectories' and sessions' states."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from storage.claims import claim_batch, record_step
from storage.engine import SessionFactory
from storage.models import Session, Trajectory
from storage.queries import create_group, create_session, insert_trajectories
from storage.records import GroupRecord, SessionRecord, StepRecord, TrajectoryRecord
from tests.support.databases import key_hash

_ids = itertools.count()
ONLINE_OWNER = "online-key-hash"


def sample(version: int, reward: float = 1.0) -> TrajectoryRecord:
    """One trajectory whose generated tokens come from `version` (its min_version)."""
    return TrajectoryRecord(
        token_ids=[5, 6, 7], loss_mask=[False, True, True], logprobs=[0.0, -1.0, -1.0],
        versions=[-1, version, version], reward=reward,
    )


async def online_samples(session_factory: SessionFactory, versions: Sequence[int]) -> list[int]:
    """One finalized online session (owned by an online key, no admission slot) per version, with one
    trajectory at that version."""
    ids: list[int] = []
    for version in versions:
        sid = f"online-{next(_ids)}"
        record = SessionRecord(id=sid, key_hash=key_hash(sid), owner_key_hash=ONLINE_OWNER)
        await create_session(session_factory, record)
        ids += await insert_trajectories(session_factory, sid, [sample(version)])
    return ids


async def admitted_group(session_factory: SessionFactory, versions: Sequence[int]) -> tuple[str, list[int]]:
    """A group the RL API admitted (its sessions hold slots), one finalized session per version."""
    gid = f"grp-{next(_ids)}"
    sessions = [SessionRecord(id=f"{gid}-{i}", key_hash=key_hash(f"{gid}-{i}"), group_id=gid, admitted=True)
                for i in range(len(versions))]
    await create_group(session_factory, GroupRecord(id=gid, size=len(versions)), sessions)
    ids: list[int] = []
    for session, version in zip(sessions, versions, strict=True):
        ids += await insert_trajectories(session_factory, session.id, [sample(version)])
    return gid, ids


@dataclass(frozen=True)
class Row:
    """A trajectory's state."""

    min_version: int
    consumed_step: int | None
    dropped_at: datetime | None
    session_id: str
    group_id: str | None


async def trajectory_rows(session_factory: SessionFactory) -> dict[int, Row]:
    async with session_factory() as db:
        rows = await db.execute(select(Trajectory.id, Trajectory.min_version, Trajectory.consumed_step,
                                       Trajectory.dropped_at, Trajectory.session_id, Trajectory.group_id))
        return {r.id: Row(r.min_version, r.consumed_step, r.dropped_at, r.session_id, r.group_id)
                for r in rows}


async def holding_slots(session_factory: SessionFactory) -> set[str]:
    """The ids of the sessions holding an admission slot."""
    async with session_factory() as db:
        return set((await db.scalars(select(Session.id).where(Session.holds_slot == True))).all())  # noqa: E712


async def train_step(session_factory: SessionFactory, step: int, staleness: int = 1000) -> int:
    """Claim everything claimable at version `step - 1` and record step `step` consuming it (a stand-in
    for the trainer); returns how many trajectories it consumed (there must be some)."""
    batch = await claim_batch(session_factory, 1024, step - 1, staleness)
    assert batch.ids, f"nothing to train step {step} on"
    record = StepRecord(step=step, policy_version=step, checkpoint_path=f"/ckpt/v{step}",
                        parent_version=step - 1)
    await record_step(session_factory, record, batch.claim_token, batch.ids)
    return len(batch)
