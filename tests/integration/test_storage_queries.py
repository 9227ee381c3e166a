"""Proxy and finalizer writes on real SQLite and Postgres: keys, groups, sessions, completions, rewards,
trajectories."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from storage.engine import SessionFactory
from storage.errors import is_session_finalized
from storage.models import Reward, Session, Trajectory
from storage.queries import (
    SessionChangedError,
    add_reward,
    create_admin_key,
    create_group,
    create_session,
    end_session,
    find_api_key,
    insert_trajectories,
    load_completion_chain,
    load_session_completions,
    record_completion,
    record_completions,
)
from storage.records import CompletionRecord, GroupRecord, SessionRecord, TrajectoryRecord
from storage.sequences import full_prompt_ids, full_token_ids
from tests.support.databases import key_hash


def _session(session_id: str, group_id: str | None = None) -> SessionRecord:
    return SessionRecord(id=session_id, key_hash=key_hash(f"key-{session_id}"), group_id=group_id)


def _completion(cid: str, session_id: str, parent_id: str | None, prompt: list[int], out: list[int]):
    return CompletionRecord(
        id=cid,
        session_id=session_id,
        parent_id=parent_id,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=np.linspace(-1, 0, len(out), dtype=np.float32),
        output_versions=[3] * len(out),
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        request_json={"messages": [{"role": "user", "content": cid}]},
        response_json={"id": cid},
    )


def _trajectory(reward: float = 1.0, version: int = 0) -> TrajectoryRecord:
    return TrajectoryRecord(
        token_ids=[1, 2, 3, 4],
        loss_mask=[False, False, True, True],
        logprobs=np.array([0, 0, -0.5, -0.25], dtype=np.float32),
        versions=[-1, -1, version, version + 1],
        reward=reward,
    )


async def _count(session_factory: SessionFactory, model: type) -> int:
    async with session_factory() as db:
        return (await db.execute(select(func.count()).select_from(model))).scalar_one()


async def test_sqlite_connections_use_wal_and_enforce_foreign_keys(engine: AsyncEngine, backend: str) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite pragmas")
    async with engine.connect() as connection:
        assert (await connection.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
        assert (await connection.exec_driver_sql("PRAGMA foreign_keys")).scalar() == 1
        assert (await connection.exec_driver_sql("PRAGMA busy_timeout")).scalar() == 30000
        assert (await connection.exec_driver_sql("PRAGMA synchronous")).scalar() == 1  # NORMAL


async def test_session_keys_and_admin_keys(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    await create_admin_key(session_factory, key_hash("admin-secret"))

    session_key = await find_api_key(session_factory, key_hash("key-s1"))
    admin_key = await find_api_key(session_factory, key_hash("admin-secret"))
    assert session_key is not None and (session_key.scope, session_key.session_id) == ("session", "s1")
    assert admin_key is not None and (admin_key.scope, admin_key.session_id) == ("admin", None)
    assert await find_api_key(session_factory, key_hash("nobody")) is None


async def test_group_refuses_more_sessions_than_its_size(session_factory: SessionFactory) -> None:
    await create_group(session_factory, GroupRecord(id="g", size=2), [_session("a", "g")])
    await create_session(session_factory, _session("b", "g"))
    with pytest.raises(ValueError, match="1 more do not fit"):
        await create_session(session_factory, _session("c", "g"))
    with pytest.raises(LookupError):
        await create_session(session_factory, _session("d", "no-such-group"))
    assert await _count(session_factory, Session) == 2


async def test_end_session(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    assert await end_session(session_factory, "s1") is True
    assert await end_session(session_factory, "s1") is False
    with pytest.raises(LookupError):
        await end_session(session_factory, "missing")


async def test_completion_chain_stores_suffixes_and_rebuilds_full_sequences(
    session_factory: SessionFactory, engine: AsyncEngine
) -> None:
    await create_session(session_factory, _session("s1"))
    await record_completion(session_factory, _completion("c1", "s1", None, [10, 11, 12], [20, 21]))
    # Group commit: a parent and its child in one batch.
    await record_completions(
        session_factory,
        [
            _completion("c2", "s1", "c1", [30], [40, 41, 42]),
            _completion("c3", "s1", "c2", [50, 51], [60]),
        ],
    )

    chain = await load_completion_chain(session_factory, "c3")
    assert [c.id for c in chain] == ["c1", "c2", "c3"]
    assert full_prompt_ids(chain).tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42, 50, 51]
    assert full_token_ids(chain).tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42, 50, 51, 60]
    assert chain[1].output_logprobs.tolist() == [-1.0, -0.5, 0.0]  # type: ignore[union-attr]
    assert await load_completion_chain(session_factory, "missing") == []

    # O(T) storage: each row holds only its own suffix.
    async with engine.connect() as connection:
        sizes = (
            await connection.execute(text("SELECT id, length(prompt_ids) FROM completions ORDER BY id"))
        ).all()
    assert [tuple(r) for r in sizes] == [("c1", 12), ("c2", 4), ("c3", 8)]


async def test_misaligned_completion_is_rejected_before_writing(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    bad = _completion("c1", "s1", None, [1], [2, 3])
    bad = CompletionRecord(**{**{f: getattr(bad, f) for f in bad.__slots__}, "output_versions": [0]})
    with pytest.raises(ValueError, match="differ in length"):
        await record_completion(session_factory, bad)
    assert await load_completion_chain(session_factory, "c1") == []


async def test_completion_batch_is_all_or_nothing(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    with pytest.raises(IntegrityError):
        await record_completions(
            session_factory,
            [_completion("c1", "s1", None, [1], [2]), _completion("c2", "no-such-session", None, [1], [2])],
        )
    assert await load_completion_chain(session_factory, "c1") == []


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_add_reward_rejects_non_finite_and_writes_nothing(
    session_factory: SessionFactory, value: float
) -> None:
    await create_session(session_factory, _session("s1"))
    with pytest.raises(ValueError, match="finite"):
        await add_reward(session_factory, value, session_id="s1")
    assert await _count(session_factory, Reward) == 0


async def test_add_reward_needs_exactly_one_target(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    await record_completion(session_factory, _completion("c1", "s1", None, [1], [2]))
    with pytest.raises(ValueError, match="exactly one"):
        await add_reward(session_factory, 1.0, session_id="s1", completion_id="c1")
    with pytest.raises(ValueError, match="exactly one"):
        await add_reward(session_factory, 1.0)

    first = await add_reward(session_factory, 0.5, session_id="s1", source="judge", details={"why": "ok"})
    second = await add_reward(session_factory, -1.0, completion_id="c1")
    async with session_factory() as db:
        rewards = (await db.execute(select(Reward).order_by(Reward.id))).scalars().all()
    assert [(r.id, r.session_id, r.completion_id, r.value, r.source, r.details) for r in rewards] == [
        (first, "s1", None, 0.5, "judge", {"why": "ok"}),
        (second, None, "c1", -1.0, "rest", {}),
    ]


async def test_schema_checks_back_up_the_python_checks(engine: AsyncEngine) -> None:
    # Writers that bypass storage.queries still cannot store a reward with two targets or none.
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO sessions (id, metadata) VALUES ('s1', '{}')"))
    with pytest.raises(IntegrityError):
        async with engine.begin() as connection:
            await connection.execute(
                text("INSERT INTO rewards (value, source, details) VALUES (1.0, 'rest', '{}')")
            )


async def test_insert_trajectories_finalizes_the_session_once(session_factory: SessionFactory) -> None:
    await create_group(session_factory, GroupRecord(id="g", size=1), [_session("s1", "g")])
    ids = await insert_trajectories(session_factory, "s1", [_trajectory(0.5, 4), _trajectory(1.0, 2)])
    assert len(ids) == 2 and ids[0] < ids[1]
    async with session_factory() as db:
        session = await db.get(Session, "s1")
        rows = (await db.execute(select(Trajectory).order_by(Trajectory.id))).scalars().all()
    assert session is not None and session.status == "finalized" and session.ended_at is not None
    assert [(t.group_id, t.min_version, t.reward) for t in rows] == [("g", 4, 0.5), ("g", 2, 1.0)]
    assert rows[0].loss_mask.tolist() == [False, False, True, True]
    assert rows[0].logprobs.dtype == np.float32

    with pytest.raises(ValueError, match="already finalized"):
        await insert_trajectories(session_factory, "s1", [_trajectory()])
    with pytest.raises(LookupError):
        await insert_trajectories(session_factory, "missing", [])
    assert await _count(session_factory, Trajectory) == 2


async def test_no_completion_joins_a_finalized_session(session_factory: SessionFactory) -> None:
    """Trajectories built from fewer completions than the session has by its finalization are not
    written (the finalizer builds them again), and once finalized no completion can join it."""
    await create_session(session_factory, _session("s1"))
    await record_completion(session_factory, _completion("c1", "s1", None, [1], [2]))
    with pytest.raises(SessionChangedError):
        await insert_trajectories(session_factory, "s1", [_trajectory()], completions=0)
    assert await _count(session_factory, Trajectory) == 0  # nothing written, the session not finalized
    await insert_trajectories(session_factory, "s1", [_trajectory()], completions=1)
    with pytest.raises(Exception, match="session_finalized") as refused:
        await record_completion(session_factory, _completion("c2", "s1", None, [1], [2]))
    assert is_session_finalized(refused.value)
    assert [c.id for c in await load_session_completions(session_factory, "s1")] == ["c1"]


async def test_trajectory_without_generated_tokens_is_rejected(session_factory: SessionFactory) -> None:
    await create_session(session_factory, _session("s1"))
    prompt_only = TrajectoryRecord(
        token_ids=[1, 2], loss_mask=[0, 0], logprobs=[0.0, 0.0], versions=[-1, -1], reward=0.0
    )
    with pytest.raises(ValueError, match="generated token"):
        await insert_trajectories(session_factory, "s1", [prompt_only])
    async with session_factory() as db:
        session = await db.get(Session, "s1")
    assert session is not None and session.status == "active"  # nothing half-written


async def test_json_with_nul_and_any_unicode_round_trips(session_factory: SessionFactory) -> None:
    # Model output can hold NUL and lone control characters; Postgres jsonb would refuse \u0000.
    await create_session(session_factory, _session("s-nul"))
    text_out = "a\x00b \x01 \ud7ff é 😀 \\u0000"
    record = _completion("c-nul", "s-nul", None, [1, 2], [3, 4])
    record = CompletionRecord(
        **{name: getattr(record, name) for name in record.__slots__ if name != "response_json"},
        response_json={"choices": [{"message": {"content": text_out}}]},
    )
    await record_completion(session_factory, record)
    (stored,) = await load_completion_chain(session_factory, "c-nul")
    assert stored.response_json["choices"][0]["message"]["content"] == text_out
