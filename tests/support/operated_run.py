"""A small run recorded with storage's own writes, for the operator's commands (`flywheel status`,
`sessions`, `export`) to read: two runs' sessions (metadata `run` "a" and "b") in every state, completions
with a parent, rewards on a session and a completion, a queued reward hook job, trajectories of known
versions and rewards, two train steps (the second's version evaluated and rejected), one claim held.

| session | run | state | trajectory versions | reward | trained |
| --- | --- | --- | --- | --- | --- |
| a-1, a-2 (group g-a) | a | finalized | 0 | 1.0, 0.0 | step 1 |
| b-1 (completions c1 → c2, c1 → c3) | b | finalized | 1..2 | 0.75 | step 2 (its version rejected) |
| b-2 | b | finalized | 2 | -1.0 | claimed, not consumed |
| b-3 | b | finalized | 2..3 | 2.0 | waiting |
| a-3 | a | active | - | - | - |
| a-4 | a | ended, its hook job queued | - | - | - |

Policy versions: 0 (promoted, eval 0.25: the best), 1 (promoted, eval 0.125: served), 2 (rejected).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import select

from rewards.hooks.spec import HookSpec, stored_hooks
from storage.claims import claim_batch, record_step
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import Trajectory
from storage.policy_versions import record_evaluation, record_initial, settle
from storage.queries import (
    add_reward,
    create_group,
    create_session,
    end_session,
    insert_trajectories,
    record_completions,
)
from storage.records import (
    CompletionRecord,
    EvalResult,
    GroupRecord,
    SessionRecord,
    StepRecord,
    TrajectoryRecord,
)
from tests.support.databases import key_hash, run_coroutine_outside_loop, storage_config

HOOKS = stored_hooks([HookSpec(hook="math")], default_max_attempts=3)


@dataclass
class OperatedRun:
    """What was written: each finalized session's trajectory, and the moment between b-1 and b-2."""

    trajectories: dict[str, TrajectoryRecord] = field(default_factory=dict)
    after_b1: datetime | None = None


def _session(
    session_id: str, run: str, group_id: str | None = None, hooks: list[dict[str, Any]] | None = None
) -> SessionRecord:
    return SessionRecord(id=session_id, key_hash=key_hash(session_id), group_id=group_id,
                         task={"question": f"task of {session_id}"}, metadata={"run": run},
                         reward_hooks=hooks)


def completion(cid: str, session_id: str, parent_id: str | None, prompt: list[int], versions: list[int],
               finish_reason: str = "stop") -> CompletionRecord:
    """A completion whose output is as long as `versions`, with distinct float32 logprobs."""
    n = len(versions)
    return CompletionRecord(
        id=cid, session_id=session_id, parent_id=parent_id, prompt_ids=prompt,
        output_ids=[100 + i for i in range(n)],
        output_logprobs=np.linspace(-2.5, -0.1, n, dtype=np.float32),
        output_versions=versions, finish_reason=finish_reason, temperature=0.7, top_p=1.0, top_k=-1,
        request_json={"messages": [{"role": "user", "content": cid}]}, response_json={"id": cid},
    )


def trajectory(prompt_len: int, versions: list[int], reward: float, seed: int) -> TrajectoryRecord:
    """A sample: `prompt_len` prompt tokens, then one token per entry of `versions` (-1: not generated,
    such as a tool's answer); generated tokens are trained and carry float32 logprobs that need every bit
    (random, not round decimals)."""
    rng = np.random.default_rng(seed)
    all_versions = np.array([-1] * prompt_len + versions, dtype=np.int32)
    trained = all_versions >= 0
    logprobs = np.zeros(len(all_versions), dtype=np.float32)
    logprobs[trained] = -rng.random(int(trained.sum()), dtype=np.float32) * 3
    return TrajectoryRecord(
        token_ids=rng.integers(0, 50_000, len(all_versions)).astype(np.int32), loss_mask=trained,
        logprobs=logprobs, versions=all_versions, reward=reward, temperature=0.7,
    )


async def record_operated_run(session_factory: SessionFactory) -> OperatedRun:
    """Write the run the module docstring tables."""
    run = OperatedRun()
    await record_initial(session_factory, "/ckpt/v0", EvalResult(score=0.25, item_scores={"x": 0.25}))

    await create_group(session_factory, GroupRecord(id="g-a", size=2),
                       [_session("a-1", "a", "g-a"), _session("a-2", "a", "g-a")])
    for i, (sid, reward) in enumerate([("a-1", 1.0), ("a-2", 0.0)]):
        await record_completions(session_factory, [completion(f"{sid}-c", sid, None, [1, 2, 3], [0, 0, 0])])
        await _finalize(session_factory, run, sid, trajectory(3, [0, 0, 0], reward, seed=i))
    await _train(session_factory, step=1, size=2, current=0, candidate=False)
    await record_evaluation(session_factory, 1, EvalResult(score=0.125, item_scores={"x": 0.125}))

    await create_session(session_factory, _session("b-1", "b"))
    await record_completions(session_factory, [
        completion("b-1-c1", "b-1", None, [1, 2, 3, 4], [1, 1]),
        completion("b-1-c2", "b-1", "b-1-c1", [5, 6], [2, 2, 2]),
        completion("b-1-c3", "b-1", "b-1-c1", [7], [2], finish_reason="length"),  # a second answer
    ])
    await add_reward(session_factory, 0.5, session_id="b-1")
    await add_reward(session_factory, 0.25, completion_id="b-1-c2")
    await end_session(session_factory, "b-1")
    await _finalize(session_factory, run, "b-1", trajectory(4, [1, 1, -1, -1, 2, 2, 2], 0.75, seed=2))
    await _train(session_factory, step=2, size=1, current=1, candidate=True)
    await settle(session_factory, 2, promoted=False, result=EvalResult(score=0.1, item_scores={"x": 0.1}),
                 reason="worse than the best")
    run.after_b1 = datetime.now(UTC)

    for seed, (sid, versions, reward) in enumerate([("b-2", [2, 2], -1.0), ("b-3", [2, 3], 2.0)], start=3):
        await create_session(session_factory, _session(sid, "b"))
        await _finalize(session_factory, run, sid, trajectory(2, versions, reward, seed=seed))
    await claim_batch(session_factory, 1, current_version=2, max_staleness=5)  # holds b-2

    await create_session(session_factory, _session("a-3", "a"))
    await record_completions(session_factory, [completion("a-3-c", "a-3", None, [9], [1])])
    await create_session(session_factory, _session("a-4", "a", hooks=HOOKS))
    await end_session(session_factory, "a-4")
    return run


async def _finalize(session_factory: SessionFactory, run: OperatedRun, session_id: str,
                    sample: TrajectoryRecord) -> None:
    await insert_trajectories(session_factory, session_id, [sample])
    run.trajectories[session_id] = sample


async def _train(
    session_factory: SessionFactory, *, step: int, size: int, current: int, candidate: bool
) -> None:
    batch = await claim_batch(session_factory, size, current_version=current, max_staleness=5)
    assert len(batch) == size, f"step {step} claimed {len(batch)} samples, not {size}"
    record = StepRecord(step=step, policy_version=step, checkpoint_path=f"/ckpt/v{step}",
                        metrics={"loss": 0.5 / step}, parent_version=current, candidate=candidate)
    await record_step(session_factory, record, batch.claim_token, batch.ids)


def record_operated_run_at(db_url: str) -> OperatedRun:
    """`record_operated_run` on the (migrated) database at `db_url`, from sync code."""

    async def record() -> OperatedRun:
        engine = create_engine(storage_config(db_url))
        try:
            return await record_operated_run(create_sessionmaker(engine))
        finally:
            await engine.dispose()

    return run_coroutine_outside_loop(record)


@dataclass(frozen=True, eq=False)
class StoredSample:
    """A trajectory as the database holds it."""

    trajectory_id: int
    session_id: str
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float


def stored_samples(db_url: str) -> dict[str, StoredSample]:
    """Every trajectory in the database, by session id (one each in the operated run)."""

    async def read() -> dict[str, StoredSample]:
        engine = create_engine(storage_config(db_url))
        try:
            async with create_sessionmaker(engine)() as db:
                rows = (await db.execute(select(Trajectory).order_by(Trajectory.id))).scalars()
                return {
                    t.session_id: StoredSample(t.id, t.session_id, t.token_ids, t.loss_mask, t.logprobs,
                                               t.versions, t.reward)
                    for t in rows
                }
        finally:
            await engine.dispose()

    return run_coroutine_outside_loop(read)
