"""The trainer's claim → step cycle on real SQLite and Postgres: whole fresh groups, disjoint concurrent
claims, one-transaction steps, released and expired claims coming back."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from sqlalchemy import select, update

from storage.claims import ClaimLostError, claim_batch, latest_policy_version, record_step, release_claim
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import PolicyVersion, TrainStep, Trajectory
from storage.queries import create_group, create_session, insert_trajectories
from storage.records import ClaimedBatch, GroupRecord, SessionRecord, StepRecord, TrajectoryRecord
from tests.support.databases import key_hash

_ids = itertools.count()


def _trajectory(version: int, reward: float = 1.0) -> TrajectoryRecord:
    return TrajectoryRecord(
        token_ids=[7, 8, 9],
        loss_mask=[False, True, True],
        logprobs=np.array([0.0, -0.5, -1.5], dtype=np.float32),
        versions=[-1, version, version + 1],  # the oldest generated token sets min_version
        reward=reward,
    )


def _new_session(group_id: str | None = None) -> SessionRecord:
    sid = f"s{next(_ids)}"
    return SessionRecord(id=sid, key_hash=key_hash(sid), group_id=group_id)


async def _group(
    session_factory: SessionFactory, size: int, version: int = 0, finalized: int | None = None
) -> tuple[str, list[int]]:
    """A group of `size` sessions, one trajectory each; only the first `finalized` are finalized."""
    gid = f"g{next(_ids)}"
    sessions = [_new_session(gid) for _ in range(size)]
    await create_group(session_factory, GroupRecord(id=gid, size=size), sessions)
    ids: list[int] = []
    for s in sessions[: size if finalized is None else finalized]:
        ids += await insert_trajectories(session_factory, s.id, [_trajectory(version)])
    return gid, ids


async def _singleton(session_factory: SessionFactory, version: int = 0) -> int:
    session = _new_session()
    await create_session(session_factory, session)
    (tid,) = await insert_trajectories(session_factory, session.id, [_trajectory(version)])
    return tid


async def _consumed(session_factory: SessionFactory) -> dict[int, int | None]:
    async with session_factory() as db:
        rows = await db.execute(select(Trajectory.id, Trajectory.consumed_step))
        return {row.id: row.consumed_step for row in rows}


def _step(step: int) -> StepRecord:
    return StepRecord(step=step, policy_version=step, checkpoint_path=f"/ckpt/{step}", metrics={"loss": 0.5})


async def test_claim_returns_the_trainer_contract(session_factory: SessionFactory) -> None:
    gid, ids = await _group(session_factory, size=2, version=3)
    batch = await claim_batch(session_factory, size=8, current_version=3, max_staleness=0)
    assert batch.ids == tuple(ids)
    sample = batch.samples[0]
    assert sample.group_id == gid and sample.reward == 1.0 and sample.min_version == 3
    assert sample.token_ids.dtype == np.int32 and sample.token_ids.tolist() == [7, 8, 9]
    assert sample.loss_mask.tolist() == [False, True, True]
    assert sample.logprobs.tolist() == [0.0, -0.5, -1.5]
    assert sample.versions.tolist() == [-1, 3, 4]


async def test_claim_takes_oldest_whole_groups_up_to_size(session_factory: SessionFactory) -> None:
    _, old_group = await _group(session_factory, size=3)
    lone = await _singleton(session_factory)
    _, young_group = await _group(session_factory, size=3)

    batch = await claim_batch(session_factory, size=5, current_version=0, max_staleness=0)
    assert batch.ids == (*old_group, lone)  # the young group does not fit whole: none of it is taken
    rest = await claim_batch(session_factory, size=5, current_version=0, max_staleness=0)
    assert rest.ids == tuple(young_group)
    assert len(await claim_batch(session_factory, size=5, current_version=0, max_staleness=0)) == 0


async def test_incomplete_groups_are_not_claimed(session_factory: SessionFactory) -> None:
    # A group with two of its three sessions finalized, and one whose third session never joined.
    gid = f"g{next(_ids)}"
    sessions = [_new_session(gid) for _ in range(3)]
    await create_group(session_factory, GroupRecord(id=gid, size=3), sessions)
    short_gid = f"g{next(_ids)}"
    short = [_new_session(short_gid) for _ in range(2)]
    await create_group(session_factory, GroupRecord(id=short_gid, size=3), short)
    finished = [*sessions[:2], *short]
    ids = [
        tid for s in finished for tid in await insert_trajectories(session_factory, s.id, [_trajectory(0)])
    ]

    assert len(await claim_batch(session_factory, size=10, current_version=0, max_staleness=0)) == 0

    # The last session of the first group finalizes: now that whole group, and only it, is claimable.
    (last,) = await insert_trajectories(session_factory, sessions[2].id, [_trajectory(0)])
    batch = await claim_batch(session_factory, size=10, current_version=0, max_staleness=0)
    assert batch.ids == (ids[0], ids[1], last)
    assert {s.group_id for s in batch.samples} == {gid}


async def test_rejected_session_still_completes_its_group(session_factory: SessionFactory) -> None:
    gid = f"g{next(_ids)}"
    sessions = [_new_session(gid) for _ in range(2)]
    await create_group(session_factory, GroupRecord(id=gid, size=2), sessions)
    (kept,) = await insert_trajectories(session_factory, sessions[0].id, [_trajectory(0)])
    await insert_trajectories(session_factory, sessions[1].id, [])  # the workflow rejected it
    batch = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)
    assert batch.ids == (kept,)


async def test_staleness_filter_excludes_old_samples(session_factory: SessionFactory) -> None:
    old = await _singleton(session_factory, version=1)
    edge = await _singleton(session_factory, version=3)
    fresh = await _singleton(session_factory, version=5)
    _, mixed_group = await _group(session_factory, size=2, version=5)
    async with session_factory.begin() as db:  # one member generated long ago: the group is held back
        await db.execute(update(Trajectory).where(Trajectory.id == mixed_group[0]).values(min_version=0))

    batch = await claim_batch(session_factory, size=10, current_version=5, max_staleness=2)
    assert batch.ids == (edge, fresh)
    assert old not in batch.ids
    everything = await claim_batch(session_factory, size=10, current_version=5, max_staleness=5)
    assert everything.ids == (old, *mixed_group)


async def test_record_step_consumes_exactly_the_claimed_ids(session_factory: SessionFactory) -> None:
    _, group = await _group(session_factory, size=2)
    other = await _singleton(session_factory)
    batch = await claim_batch(session_factory, size=2, current_version=0, max_staleness=0)
    assert batch.ids == tuple(group)

    await record_step(session_factory, _step(1), batch.claim_token, batch.ids)
    assert await _consumed(session_factory) == {group[0]: 1, group[1]: 1, other: None}
    assert await latest_policy_version(session_factory) == 1
    async with session_factory() as db:
        step = await db.get(TrainStep, 1)
    assert step is not None and step.policy_version == 1 and step.metrics == {"loss": 0.5}
    # Consumed trajectories are never claimed again.
    assert (await claim_batch(session_factory, size=8, current_version=0, max_staleness=0)).ids == (other,)


async def test_second_record_step_with_the_same_ids_fails_and_writes_nothing(
    session_factory: SessionFactory,
) -> None:
    _, group = await _group(session_factory, size=2)
    batch = await claim_batch(session_factory, size=2, current_version=0, max_staleness=0)
    await record_step(session_factory, _step(1), batch.claim_token, batch.ids)

    with pytest.raises(ClaimLostError, match="2 of 2"):
        await record_step(session_factory, _step(2), batch.claim_token, batch.ids)
    assert await _consumed(session_factory) == dict.fromkeys(group, 1)
    async with session_factory() as db:
        assert await db.get(TrainStep, 2) is None
        assert await db.get(PolicyVersion, 2) is None
    assert await latest_policy_version(session_factory) == 1


async def test_record_step_with_a_foreign_id_rolls_everything_back(session_factory: SessionFactory) -> None:
    mine = await _singleton(session_factory)
    batch = await claim_batch(session_factory, size=1, current_version=0, max_staleness=0)
    unclaimed = await _singleton(session_factory)
    with pytest.raises(ClaimLostError, match="1 of 2"):
        await record_step(session_factory, _step(1), batch.claim_token, [mine, unclaimed])
    assert await _consumed(session_factory) == {mine: None, unclaimed: None}
    assert await latest_policy_version(session_factory) is None
    # The claim itself is intact: the same step with the right ids now succeeds.
    await record_step(session_factory, _step(1), batch.claim_token, batch.ids)
    assert await _consumed(session_factory) == {mine: 1, unclaimed: None}


async def test_released_claim_is_claimable_again(session_factory: SessionFactory) -> None:
    _, group = await _group(session_factory, size=2)
    first = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)
    assert len(await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)) == 0

    assert await release_claim(session_factory, first.claim_token) == 2
    second = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)
    assert second.ids == tuple(group) and second.claim_token != first.claim_token
    # The released token holds nothing any more.
    with pytest.raises(ClaimLostError):
        await record_step(session_factory, _step(1), first.claim_token, first.ids)
    await record_step(session_factory, _step(1), second.claim_token, second.ids)


async def test_expired_claim_is_taken_over_and_its_owner_cannot_record(
    session_factory: SessionFactory,
) -> None:
    _, group = await _group(session_factory, size=2)
    dead = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0)
    live_lease = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0, lease_s=3600)
    assert len(live_lease) == 0

    takeover = await claim_batch(session_factory, size=4, current_version=0, max_staleness=0, lease_s=0)
    assert takeover.ids == tuple(group)
    with pytest.raises(ClaimLostError):
        await record_step(session_factory, _step(1), dead.claim_token, dead.ids)
    await record_step(session_factory, _step(1), takeover.claim_token, takeover.ids)
    assert await _consumed(session_factory) == dict.fromkeys(group, 1)


async def _drain(url: str, size: int, start: asyncio.Barrier) -> list[ClaimedBatch]:
    """One trainer process: its own engine and connection, claiming until nothing is left."""
    engine = create_engine(StorageConfig(url=url, pool_size=1))
    factory = create_sessionmaker(engine)
    batches: list[ClaimedBatch] = []
    try:
        async with engine.connect():  # connect first, so that every claimer starts at the same moment
            pass
        await start.wait()
        while batch := await claim_batch(factory, size=size, current_version=0, max_staleness=0):
            batches.append(batch)
            await asyncio.sleep(0.02)  # the train step, during which the others claim
    finally:
        await engine.dispose()
    return batches


async def test_concurrent_claimers_never_share_a_trajectory(
    session_factory: SessionFactory, db_url: str
) -> None:
    groups: dict[str, set[int]] = {}
    singletons: set[int] = set()
    for i in range(40):  # interleave groups of several sizes with singletons
        if i % 3 == 2:
            singletons.add(await _singleton(session_factory))
        else:
            gid, ids = await _group(session_factory, size=1 + i % 4)
            groups[gid] = set(ids)
    everything = singletons.union(*groups.values())

    start = asyncio.Barrier(4)
    claimers = await asyncio.gather(*(_drain(db_url, 5, start) for _ in range(4)))

    claimed = [tid for batches in claimers for batch in batches for tid in batch.ids]
    assert len(claimed) == len(set(claimed)), "a trajectory was claimed twice"
    assert set(claimed) == everything
    tokens = [batch.claim_token for batches in claimers for batch in batches]
    assert len(tokens) == len(set(tokens))
    for batches in claimers:
        for batch in batches:  # whole groups, never more than asked for
            assert len(batch) <= 5
            for gid in {s.group_id for s in batch.samples if s.group_id}:
                assert groups[gid] <= set(batch.ids)
    assert sum(1 for batches in claimers if batches) >= 2, "the claimers did not overlap at all"
