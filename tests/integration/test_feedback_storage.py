"""storage/feedback.py on SQLite and Postgres: feedback on a finalized session racing a trainer's claim of
its trajectory. Whoever wins, the trainer never trains on a reward other than the one stored: a feedback
applied before the claim is in the claimed sample, and one that comes after is late and changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses

from sqlalchemy import func, select

from storage.claims import claim_batch
from storage.engine import SessionFactory
from storage.feedback import FeedbackEntry, record_feedback
from storage.models import Reward, Trajectory
from storage.queries import create_session, end_session, insert_trajectories, record_completion
from storage.records import SessionRecord, TrajectoryRecord
from tests.support.completion_records import completion
from tests.support.databases import key_hash

ROUNDS = 12


async def finalized_session(factory: SessionFactory, index: int) -> tuple[str, str]:
    """(session id, completion id) of a finalized session whose one trajectory (reward 1.0, from no feedback)
    trains its one completion."""
    session_id, completion_id = f"sess-{index}", f"chatcmpl-{index}"
    await create_session(factory, SessionRecord(id=session_id, key_hash=key_hash(f"key-{index}")))
    record = dataclasses.replace(completion(completion_id, [1, 2], [3, 4]), session_id=session_id)
    await record_completion(factory, record)
    await end_session(factory, session_id)
    sample = TrajectoryRecord(
        token_ids=[1, 2, 3, 4],
        loss_mask=[False, False, True, True],
        logprobs=[0.0, 0.0, -0.1, -0.2],
        versions=[-1, -1, 0, 1],
        reward=1.0,
        completion_ids=(completion_id,),
    )
    await insert_trajectories(factory, session_id, [sample])
    return session_id, completion_id


async def stored_reward(factory: SessionFactory, session_id: str, completion_id: str) -> tuple[float, int]:
    """The session's trajectory's reward, and how many rewards its completion has."""
    async with factory() as db:
        query = select(Trajectory.reward).where(Trajectory.session_id == session_id)
        reward = (await db.execute(query)).scalar_one()
        count = select(func.count()).select_from(Reward).where(Reward.completion_id == completion_id)
        return reward, int(await db.scalar(count) or 0)


async def test_feedback_racing_a_claim_never_changes_a_claimed_reward(
    session_factory: SessionFactory,
) -> None:
    for index in range(ROUNDS):
        session_id, completion_id = await finalized_session(session_factory, index)
        entry = FeedbackEntry(
            completion_id=completion_id,
            session_id=session_id,
            key_hash=key_hash("user"),
            value=-1.0,
            thumbs="down",
            comment=None,
            source="feedback",
        )
        batch, outcome = await asyncio.gather(
            claim_batch(session_factory, 1, 1, 1), record_feedback(session_factory, entry)
        )
        reward, rewards = await stored_reward(session_factory, session_id, completion_id)
        for sample in batch.samples:
            assert sample.reward == reward  # the trainer trains on what is stored, feedback or not
        if outcome.state == "applied":
            assert (reward, rewards) == (0.0, 1) and outcome.reward_id is not None  # 1.0 + (-1.0 - nothing)
        else:
            assert outcome.state == "late" and outcome.reward_id is None
            assert (reward, rewards) == (1.0, 0) and batch.samples  # late because the claim came first
        await claim_batch(session_factory, 64, 1, 1)  # whatever is left stays out of the next round
