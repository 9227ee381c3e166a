"""Finishing a recorded session as an RL client would (a reward, an end, the finalizer), and reading back
the trajectories it became. Pass these to `run_db` (tests/support/proxy_harness.py)."""

from __future__ import annotations

from sqlalchemy import select

from rewards.config import FinalizerConfig
from rewards.finalizer import SessionFinalizer
from storage.engine import SessionFactory
from storage.models import Trajectory
from storage.queries import add_reward, end_session


async def reward_end_and_finalize(factory: SessionFactory, session_id: str) -> int:
    """Reward the session 1.0, end it and finalize it; the number of trajectories written."""
    await add_reward(factory, 1.0, session_id=session_id)
    await end_session(factory, session_id)
    return await SessionFinalizer(factory, FinalizerConfig()).finalize(session_id)


async def session_trajectories(factory: SessionFactory, session_id: str) -> list[Trajectory]:
    async with factory() as db:
        query = select(Trajectory).where(Trajectory.session_id == session_id)
        return list((await db.execute(query)).scalars())
