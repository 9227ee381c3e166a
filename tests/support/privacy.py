"""Reading and shaping what the database holds for the privacy tests (pass these to `run_db`,
tests/support/proxy_harness.py): every stored JSON text, sessions aged, trajectories consumed as a
trainer consumes them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, update

from storage.claims import claim_batch, record_step, release_claim
from storage.engine import SessionFactory, write_transaction
from storage.models import Completion, Reward, RewardJob, Session, Trajectory
from storage.records import StepRecord


async def stored_json(factory: SessionFactory) -> str:
    """Every JSON column that may hold served text, as one text: completions' request and response,
    rewards' details, reward jobs' results."""
    async with factory() as db:
        rows = [
            *(await db.execute(select(Completion.request_json, Completion.response_json))).all(),
            *(await db.execute(select(Reward.details))).all(),
            *(await db.execute(select(RewardJob.result))).all(),
        ]
    return "\n".join(json.dumps(list(row), ensure_ascii=False) for row in rows)


async def trajectory_ids(factory: SessionFactory, session_id: str) -> list[int]:
    async with factory() as db:
        query = select(Trajectory.id).where(Trajectory.session_id == session_id).order_by(Trajectory.id)
        return list((await db.execute(query)).scalars())


async def consume(factory: SessionFactory, ids: Sequence[int], step: int) -> None:
    """Train on exactly the trajectories `ids` as a trainer does: claim, record step `step` consuming
    them, give the rest of the claim back."""
    batch = await claim_batch(factory, 1000, step - 1, 1000)
    assert set(ids) <= set(batch.ids), "the trajectories to consume were not claimable"
    await record_step(
        factory,
        StepRecord(step=step, policy_version=step, checkpoint_path=f"/ckpt/{step}"),
        batch.claim_token,
        list(ids),
    )
    await release_claim(factory, batch.claim_token)


async def age(factory: SessionFactory, session_id: str, seconds: float) -> None:
    """Move a session's end `seconds` into the past."""
    async with write_transaction(factory) as db:
        ended = datetime.now(UTC) - timedelta(seconds=seconds)
        await db.execute(update(Session).where(Session.id == session_id).values(ended_at=ended))
