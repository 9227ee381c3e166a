"""The session finalizer on real SQLite and Postgres: trajectories written once with every field right,
readiness, the missing-reward policy, the sweep (TTL, grace) and the temperature column's migration."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from sqlalchemy import func, insert, select, update

from rewards.config import FinalizerConfig
from rewards.finalizer import SessionActiveError, SessionFinalizer
from storage.claims import claim_batch
from storage.engine import SessionFactory, write_transaction
from storage.models import Completion, Session, Trajectory
from storage.queries import (
    add_reward,
    create_group,
    create_session,
    end_session,
    record_completions,
)
from storage.records import CompletionRecord, GroupRecord, SessionRecord
from tests.support.databases import key_hash, run_outside_loop

_ids = itertools.count()


def _completion(
    session_id: str, prompt: list[int], output: list[int], *, parent: str | None = None,
    version: int = 0, finish: str = "stop", temperature: float = 0.8,
) -> CompletionRecord:
    return CompletionRecord(
        id=f"chatcmpl-{next(_ids)}",
        session_id=session_id,
        parent_id=parent,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=np.linspace(-0.1, -1.0, len(output), dtype=np.float32),
        output_versions=[version] * len(output),
        finish_reason=finish,
        temperature=temperature,
        top_p=1.0,
        top_k=-1,
        request_json={"messages": []},
        response_json={},
    )


async def _session(session_factory: SessionFactory, group_id: str | None = None) -> str:
    sid = f"sess-{next(_ids)}"
    record = SessionRecord(id=sid, key_hash=key_hash(sid), group_id=group_id)
    await create_session(session_factory, record)
    return sid


async def _three_turns(session_factory: SessionFactory, sid: str) -> list[CompletionRecord]:
    """Turn 1, turn 2 extending it, an aborted retry of turn 3, then turn 3 extending turn 2."""
    first = _completion(sid, [1, 2, 3], [10, 11], version=0, temperature=0.8)
    second = _completion(sid, [4], [12, 13, 14], parent=first.id, version=1, temperature=0.8)
    aborted = _completion(sid, [5], [15], parent=second.id, finish="abort")
    third = _completion(sid, [5], [16], parent=second.id, version=2, temperature=0.5)
    for record in (first, second, aborted, third):  # one at a time: distinct created_at, call order
        await record_completions(session_factory, [record])
    return [first, second, aborted, third]


async def _trajectories(session_factory: SessionFactory, sid: str | None = None) -> list[Trajectory]:
    query = select(Trajectory).order_by(Trajectory.id)
    if sid is not None:
        query = query.where(Trajectory.session_id == sid)
    async with session_factory() as db:
        return list((await db.execute(query)).scalars())


async def _status(session_factory: SessionFactory, sid: str) -> str:
    async with session_factory() as db:
        return (await db.execute(select(Session.status).where(Session.id == sid))).scalar_one()


async def test_finalize_writes_every_field(session_factory: SessionFactory) -> None:
    sid = await _session(session_factory)
    first, second, _aborted, third = await _three_turns(session_factory, sid)
    await add_reward(session_factory, 1.0, completion_id=first.id)
    await add_reward(session_factory, 2.0, session_id=sid)
    await end_session(session_factory, sid)
    finalizer = SessionFinalizer(session_factory, FinalizerConfig(style="individual", turn_discount=0.5))

    assert await finalizer.finalize(sid) == 3

    rows = await _trajectories(session_factory, sid)
    # r = [1, 0, 2] over the trainable turns; R = [1 + 0.5·(0 + 0.5·2), 0.5·2, 2].
    assert [t.reward for t in rows] == [1.5, 1.0, 2.0]
    assert rows[0].token_ids.tolist() == [1, 2, 3, 10, 11]
    assert rows[1].token_ids.tolist() == [1, 2, 3, 10, 11, 4, 12, 13, 14]
    assert rows[2].token_ids.tolist() == [1, 2, 3, 10, 11, 4, 12, 13, 14, 5, 16]
    for row, source in zip(rows, [first, second, third], strict=True):
        n_out = len(source.output_ids)
        n_prompt = len(row.token_ids) - n_out
        assert row.loss_mask.tolist() == [False] * n_prompt + [True] * n_out
        assert row.logprobs[:n_prompt].tolist() == [0.0] * n_prompt
        assert row.logprobs[n_prompt:].tolist() == np.asarray(source.output_logprobs).tolist()
        assert row.versions.tolist() == [-1] * n_prompt + list(source.output_versions)
        assert row.token_ids[n_prompt:].tolist() == list(source.output_ids)
        assert row.temperature == source.temperature
        assert row.min_version == min(source.output_versions)
        assert row.group_id is None
    assert await _status(session_factory, sid) == "finalized"

    batch = await claim_batch(session_factory, size=8, current_version=2, max_staleness=2)
    assert [s.temperature for s in batch.samples] == [0.8, 0.8, 0.5]


async def test_finalize_is_once_even_when_concurrent(session_factory: SessionFactory) -> None:
    sid = await _session(session_factory)
    await _three_turns(session_factory, sid)
    await add_reward(session_factory, 1.0, session_id=sid)
    await end_session(session_factory, sid)
    # Two finalizers stand for two processes: no shared in-process guard, only the database.
    one = SessionFinalizer(session_factory, FinalizerConfig())
    two = SessionFinalizer(session_factory, FinalizerConfig())

    written = await asyncio.gather(one.finalize(sid), two.finalize(sid), one.finalize(sid))

    assert sorted(written) == [0, 0, 2]  # one trajectory per chain: the aborted retry's, then turn 3's
    assert len(await _trajectories(session_factory, sid)) == 2
    assert await one.finalize(sid) == 0


async def test_finalize_needs_an_ended_known_session(session_factory: SessionFactory) -> None:
    sid = await _session(session_factory)
    finalizer = SessionFinalizer(session_factory, FinalizerConfig())
    with pytest.raises(SessionActiveError):
        await finalizer.finalize(sid)
    assert await finalizer.finalize_if_ready(sid) is None
    with pytest.raises(LookupError):
        await finalizer.finalize("no-such-session")
    assert await _status(session_factory, sid) == "active"


async def test_ready_needs_a_session_reward_or_every_completion_rewarded(
    session_factory: SessionFactory,
) -> None:
    sid = await _session(session_factory)
    first, second, _aborted, third = await _three_turns(session_factory, sid)
    await end_session(session_factory, sid)
    finalizer = SessionFinalizer(session_factory, FinalizerConfig())

    assert await finalizer.finalize_if_ready(sid) is None
    await add_reward(session_factory, 1.0, completion_id=first.id)
    await add_reward(session_factory, 1.0, completion_id=third.id)
    assert await finalizer.finalize_if_ready(sid) is None  # `second` still has none
    await add_reward(session_factory, 1.0, completion_id=second.id)
    assert await finalizer.finalize_if_ready(sid) == 2
    # Chains (by leaf): first → second → aborted retry (returns 1 + 1), first → second → third (1 + 1 + 1).
    assert [t.reward for t in await _trajectories(session_factory, sid)] == [2.0, 3.0]


@pytest.mark.parametrize(("policy", "expected"), [("zero", [0.0, 0.0]), ("drop", [])])
async def test_missing_reward_policy(
    session_factory: SessionFactory, policy: str, expected: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    sid = await _session(session_factory)
    await _three_turns(session_factory, sid)
    await end_session(session_factory, sid)
    finalizer = SessionFinalizer(session_factory, FinalizerConfig(missing_reward=policy))  # type: ignore[arg-type]

    assert await finalizer.finalize(sid) == len(expected)

    assert [t.reward for t in await _trajectories(session_factory, sid)] == expected
    assert await _status(session_factory, sid) == "finalized"
    assert "without any reward" in caplog.text


async def test_a_session_may_ask_to_be_dropped_when_unrewarded(session_factory: SessionFactory) -> None:
    sid = "sess-says-drop"
    record = SessionRecord(id=sid, key_hash=key_hash(sid), metadata={"missing_reward": "drop"})
    await create_session(session_factory, record)
    await _three_turns(session_factory, sid)
    await end_session(session_factory, sid)
    finalizer = SessionFinalizer(session_factory, FinalizerConfig(missing_reward="zero"))

    assert await finalizer.finalize(sid) == 0
    assert await _trajectories(session_factory, sid) == []
    assert await _status(session_factory, sid) == "finalized"


async def _age(session_factory: SessionFactory, sid: str, **columns: datetime) -> None:
    async with write_transaction(session_factory) as db:
        await db.execute(update(Session).where(Session.id == sid).values(**columns))


async def test_sweep_ttl_grace_and_ready(session_factory: SessionFactory) -> None:
    config = FinalizerConfig(session_ttl_s=600, reward_grace_s=60)
    finalizer = SessionFinalizer(session_factory, config)
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    fresh_active, expired, rewarded, waiting, waited = [await _session(session_factory) for _ in range(5)]
    for sid in (expired, rewarded, waiting, waited):
        await record_completions(session_factory, [_completion(sid, [1], [2])])
    await _age(session_factory, expired, created_at=long_ago)
    await add_reward(session_factory, 1.0, session_id=rewarded)
    for sid in (rewarded, waiting, waited):
        await end_session(session_factory, sid)
    await _age(session_factory, waited, ended_at=long_ago)

    assert await finalizer.sweep() == 3

    everyone = (fresh_active, expired, rewarded, waiting, waited)
    statuses = {sid: await _status(session_factory, sid) for sid in everyone}
    assert statuses == {
        fresh_active: "active",
        expired: "finalized",
        rewarded: "finalized",
        waiting: "ended",  # still inside its grace period for a reward
        waited: "finalized",
    }
    assert await finalizer.sweep() == 0


async def test_run_sweeps_until_stopped(session_factory: SessionFactory) -> None:
    finalizer = SessionFinalizer(session_factory, FinalizerConfig(sweep_interval_s=0.01))
    sid = await _session(session_factory)
    await record_completions(session_factory, [_completion(sid, [1], [2])])
    stop = asyncio.Event()
    runner = asyncio.create_task(finalizer.run(stop))
    await end_session(session_factory, sid)
    await add_reward(session_factory, 1.0, session_id=sid)
    for _ in range(500):
        if await _status(session_factory, sid) == "finalized":
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(runner, timeout=5)
    assert await _status(session_factory, sid) == "finalized"


async def test_scheduled_finalizations_are_awaitable(session_factory: SessionFactory) -> None:
    finalizer = SessionFinalizer(session_factory, FinalizerConfig())
    gid = f"group-{next(_ids)}"
    sids = [f"sess-{next(_ids)}" for _ in range(3)]
    await create_group(
        session_factory,
        GroupRecord(id=gid, size=3),
        [SessionRecord(id=s, key_hash=key_hash(s), group_id=gid) for s in sids],
    )
    for sid in sids:
        await record_completions(session_factory, [_completion(sid, [1, 2], [3, 4])])
        await add_reward(session_factory, 1.0, session_id=sid)
        await end_session(session_factory, sid)
        finalizer.schedule(sid)
        finalizer.schedule(sid)  # a duplicate request writes nothing more
    await finalizer.wait_idle()

    rows = await _trajectories(session_factory)
    assert len(rows) == 3 and {t.group_id for t in rows} == {gid}
    batch = await claim_batch(session_factory, size=3, current_version=0, max_staleness=0)
    assert len(batch) == 3


def test_migration_fills_temperature_of_existing_rows(empty_db_url: str) -> None:
    from storage.config import StorageConfig
    from storage.engine import create_engine, create_sessionmaker
    from storage.migrate import upgrade

    async def write_v1_trajectory() -> None:
        engine = create_engine(StorageConfig(url=empty_db_url))
        async with engine.begin() as connection:
            await connection.execute(
                insert(Session.__table__).values(id="old", metadata={}, status="ended", ended_at=func.now())
            )
            await connection.exec_driver_sql(
                "INSERT INTO trajectories (session_id, token_ids, loss_mask, logprobs, versions, reward,"
                " min_version) VALUES ('old', %s, %s, %s, %s, 1.0, 0)" % ((_blob(engine.dialect.name),) * 4)
            )
        await engine.dispose()

    async def read_temperature() -> float:
        engine = create_engine(StorageConfig(url=empty_db_url))
        async with create_sessionmaker(engine)() as db:
            value = (await db.execute(select(Trajectory.temperature))).scalar_one()
        await engine.dispose()
        return value

    run_outside_loop(upgrade, empty_db_url, "0001")
    run_outside_loop(lambda: asyncio.run(write_v1_trajectory()))
    run_outside_loop(upgrade, empty_db_url)
    assert run_outside_loop(lambda: asyncio.run(read_temperature())) == 1.0


def _blob(dialect: str) -> str:
    # Empty arrays satisfy the length check; SQLite and Postgres spell an empty blob differently.
    return "X''" if dialect == "sqlite" else "''::bytea"


async def test_an_online_session_expires_when_idle_not_when_old(session_factory: SessionFactory) -> None:
    config = FinalizerConfig(session_ttl_s=600, reward_grace_s=60)
    finalizer = SessionFinalizer(session_factory, config)
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    talking, idle = f"sess-{next(_ids)}", f"sess-{next(_ids)}"
    for sid in (talking, idle):
        record = SessionRecord(id=sid, key_hash=key_hash(sid), owner_key_hash=key_hash("online"))
        await create_session(session_factory, record)
        await _age(session_factory, sid, created_at=long_ago)
    await record_completions(session_factory, [_completion(talking, [1], [2])])  # a call just now
    quiet = _completion(idle, [1], [2])
    await record_completions(session_factory, [quiet])
    async with write_transaction(session_factory) as db:
        await db.execute(update(Completion).where(Completion.id == quiet.id).values(created_at=long_ago))

    await finalizer.sweep()

    assert await _status(session_factory, talking) == "active"
    assert await _status(session_factory, idle) == "finalized"
