"""The trainer's side of storage: claim whole, complete, fresh groups of trajectories; record a step and
consume exactly its trajectories in one transaction; release the claim of a step that failed.

A claim unit is a whole group (every trajectory of a group whose `size` sessions are all finalized) or
one trajectory without a group. On Postgres, concurrent claimers lock units with `FOR UPDATE SKIP LOCKED`
(the group row for a group, then the trajectory rows) and never wait on each other; on SQLite the claim
runs under BEGIN IMMEDIATE, so claimers take turns. Either way two claims never share a trajectory.

A sample older than η is not claimable, and as the trainer's version moves on it never will be: the
trainer's claims drop it (`drop_stale`), with the rest of its group, so it is no longer considered and
is counted; sessions left with nothing to train free their admission slots (storage/admission.py). A
trajectory is consumed once or dropped, never both.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.admission import release_slots
from storage.engine import SessionFactory, affected_rows, write_transaction
from storage.models import Group, PolicyVersion, Session, SessionStatus, TrainStep, Trajectory, VersionStatus
from storage.records import ClaimedBatch, StepRecord, TrainingSample

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 600.0
"""A claim older than this may be taken over: its trainer is presumed dead."""

_MIN_SCAN = 256  # candidate rows read per round; whole groups are then completed from their members
_MAX_STALE = 512  # stale rows one claim drops (with their groups); the rest go at the next claims


class ClaimLostError(RuntimeError):
    """record_step found a trajectory already consumed, or no longer held by the given claim."""


@dataclass(frozen=True, slots=True)
class _Filter:
    floor: int  # oldest behaviour version still fresh enough
    lease_cutoff: datetime  # claims made at or before this have expired


@dataclass(frozen=True, slots=True)
class _Unit:
    group_id: str | None
    ids: tuple[int, ...]


async def claim_batch(
    session_factory: SessionFactory,
    size: int,
    current_version: int,
    max_staleness: int,
    *,
    lease_s: float = DEFAULT_LEASE_S,
    drop_stale: bool = False,
    claim_token: str | None = None,
) -> ClaimedBatch:
    """Claim up to `size` unconsumed trajectories, oldest first, whole groups only, whose every generated
    token is at most `max_staleness` versions behind `current_version`. May return an empty batch.
    With `drop_stale` (the trainer's claims), first drop the unclaimed samples older than that and the
    other members of their groups (`dropped_at`), in the same transaction; the batch counts them.
    `claim_token` is the token to claim with (default: a new one); a trainer that notes it before the
    claim can give the claim back after a crash however early in the step it died."""
    if size < 1 or max_staleness < 0 or lease_s < 0:
        raise ValueError("size must be >= 1, max_staleness and lease_s >= 0")
    now = datetime.now(UTC)
    filt = _Filter(floor=current_version - max_staleness, lease_cutoff=now - timedelta(seconds=lease_s))
    token = claim_token or str(uuid.uuid4())
    async with write_transaction(session_factory) as db:
        dropped = await _drop_stale(db, filt, now) if drop_stale else 0
        ids = await _claim_units(db, size, filt)
        if not ids:
            return ClaimedBatch(claim_token=token, samples=(), dropped=dropped)
        await db.execute(
            update(Trajectory).where(Trajectory.id.in_(ids)).values(claim_token=token, claimed_at=now)
        )
        samples = await _load_samples(db, ids)
    return ClaimedBatch(claim_token=token, samples=samples, dropped=dropped)


async def release_claim(session_factory: SessionFactory, claim_token: str) -> int:
    """Give back a claim's unconsumed trajectories (a step failed); returns how many."""
    async with write_transaction(session_factory) as db:
        result = await db.execute(
            update(Trajectory)
            .where(Trajectory.claim_token == claim_token, Trajectory.consumed_step.is_(None))
            .values(claim_token=None, claimed_at=None)
        )
        return affected_rows(result)


async def record_step(
    session_factory: SessionFactory, step: StepRecord, claim_token: str, ids: Sequence[int]
) -> None:
    """In one transaction: the policy version and train step rows, and `consumed_step` on exactly `ids`.
    ClaimLostError, and nothing written, if any id is consumed already or not held by `claim_token`
    (its lease expired and another trainer took it). Ids of the claim not listed stay claimed."""
    if not ids or len(set(ids)) != len(ids):
        raise ValueError("record_step needs distinct trajectory ids")
    async with write_transaction(session_factory) as db:
        status = VersionStatus.CANDIDATE if step.candidate else VersionStatus.PROMOTED
        await db.execute(
            insert(PolicyVersion).values(
                version=step.policy_version,
                checkpoint_path=step.checkpoint_path,
                status=status.value,
                parent_version=step.parent_version,
                served_at=None if step.candidate else datetime.now(UTC),
            )
        )
        await db.execute(
            insert(TrainStep).values(step=step.step, policy_version=step.policy_version, metrics=step.metrics)
        )
        result = await db.execute(
            update(Trajectory)
            .where(
                Trajectory.id.in_(ids),
                Trajectory.claim_token == claim_token,
                Trajectory.consumed_step.is_(None),
            )
            .values(consumed_step=step.step)
        )
        consumed = affected_rows(result)
        if consumed != len(ids):  # raising here rolls the whole transaction back
            raise ClaimLostError(
                f"step {step.step}: {len(ids) - consumed} of {len(ids)} trajectories are consumed "
                f"already or not held by claim {claim_token}"
            )


async def latest_policy_version(session_factory: SessionFactory) -> int | None:
    """The newest recorded policy version; None before the first step."""
    async with session_factory() as db:
        return await db.scalar(select(func.max(PolicyVersion.version)))


async def _claim_units(db: AsyncSession, size: int, filt: _Filter) -> list[int]:
    claimed: list[int] = []
    seen_groups: set[str] = set()
    after = 0
    scan = max(4 * size, _MIN_SCAN)
    while len(claimed) < size:
        rows = (await db.execute(_candidates(filt, after, scan))).all()
        if not rows:
            break
        after = rows[-1].id
        units = await _units(db, rows, seen_groups)
        for unit in units:
            if len(unit.ids) > size:
                logger.warning(
                    "group %s has %d trajectories, more than a batch of %d: it is never claimed",
                    unit.group_id,
                    len(unit.ids),
                    size,
                )
        while units and len(claimed) < size:
            planned = _fit(units, size - len(claimed))
            if not planned:
                break
            claimed.extend(await _lock(db, planned, filt))
            tried = set(planned)  # won, or held by a concurrent claimer: plan from the rest
            units = [u for u in units if u not in tried]
        if len(rows) < scan:
            break
    return claimed


def _free(t: Any, filt: _Filter) -> ColumnElement[bool]:
    """Neither consumed nor dropped, and unclaimed (or its claim expired)."""
    return and_(
        t.consumed_step.is_(None),
        t.dropped_at.is_(None),
        or_(t.claim_token.is_(None), t.claimed_at <= filt.lease_cutoff),
    )


def _claimable(t: Any, filt: _Filter) -> ColumnElement[bool]:
    return and_(_free(t, filt), t.min_version >= filt.floor)


async def _drop_stale(db: AsyncSession, filt: _Filter, now: datetime) -> int:
    """Mark dropped the free samples older than the floor and the free members of their groups (a group
    is trained whole or not at all), skipping rows a concurrent claimer holds (never waiting on it), and
    free the admission slots of their sessions that have nothing left to train. Returns how many."""
    stale = (
        await db.execute(
            select(Trajectory.id, Trajectory.group_id, Trajectory.session_id)
            .where(_free(Trajectory, filt), Trajectory.min_version < filt.floor)
            .limit(_MAX_STALE)
            .with_for_update(skip_locked=True)
        )
    ).all()
    if not stale:
        return 0
    owners = {row.id: row.session_id for row in stale}  # trajectory → its session
    groups = {row.group_id for row in stale if row.group_id is not None}
    if groups:
        members = await db.execute(
            select(Trajectory.id, Trajectory.session_id)
            .where(Trajectory.group_id.in_(groups), _free(Trajectory, filt))
            .with_for_update(skip_locked=True)
        )
        owners.update({row.id: row.session_id for row in members})
    result = await db.execute(
        update(Trajectory)
        .where(Trajectory.id.in_(list(owners)), _free(Trajectory, filt))
        .values(dropped_at=now, claim_token=None, claimed_at=None)
    )
    dropped = affected_rows(result)
    await release_slots(db, set(owners.values()))
    logger.info("dropped %d samples older than version %d (or in a group with one)", dropped, filt.floor)
    return dropped


def _candidates(filt: _Filter, after: int, limit: int) -> Any:
    """Claimable rows, oldest first, whose unit is complete and has no member that holds it back
    (consumed, under a live claim, or stale): a group is claimed whole or not at all."""
    member = aliased(Trajectory)
    group_size = select(Group.size).where(Group.id == Trajectory.group_id).scalar_subquery()
    finalized = (
        select(func.count())
        .select_from(Session)
        .where(Session.group_id == Trajectory.group_id, Session.status == SessionStatus.FINALIZED.value)
        .scalar_subquery()
    )
    held_back = exists().where(member.group_id == Trajectory.group_id, ~_claimable(member, filt))
    group_ready = and_(group_size == finalized, ~held_back)
    return (
        select(Trajectory.id, Trajectory.group_id)
        .where(Trajectory.id > after, _claimable(Trajectory, filt))
        .where(or_(Trajectory.group_id.is_(None), group_ready))
        .order_by(Trajectory.id)
        .limit(limit)
    )


async def _units(db: AsyncSession, rows: Sequence[Any], seen_groups: set[str]) -> list[_Unit]:
    """Units in order of their oldest row; each group with all its members (some may lie past the scan)."""
    new_groups = list(dict.fromkeys(r.group_id for r in rows if r.group_id and r.group_id not in seen_groups))
    members: dict[str, list[int]] = {g: [] for g in new_groups}
    if new_groups:
        member_rows = await db.execute(
            select(Trajectory.id, Trajectory.group_id)
            .where(Trajectory.group_id.in_(new_groups))
            .order_by(Trajectory.id)
        )
        for row in member_rows:
            members[row.group_id].append(row.id)
    seen_groups.update(new_groups)
    units: list[_Unit] = []
    for row in rows:
        if row.group_id is None:
            units.append(_Unit(None, (row.id,)))
        elif row.group_id in members:
            units.append(_Unit(row.group_id, tuple(members.pop(row.group_id))))
    return units


def _fit(units: Sequence[_Unit], budget: int) -> list[_Unit]:
    """Oldest first; a unit too big for what is left is passed over for smaller, younger ones."""
    chosen: list[_Unit] = []
    for unit in units:
        if len(unit.ids) <= budget:
            chosen.append(unit)
            budget -= len(unit.ids)
    return chosen


async def _lock(db: AsyncSession, units: Sequence[_Unit], filt: _Filter) -> list[int]:
    """The ids of the units this transaction now holds whole; units another claimer holds are skipped."""
    group_ids = [u.group_id for u in units if u.group_id is not None]
    locked_groups: set[str] = set()
    if group_ids:  # the group row is the lock for its trajectories
        locked_groups = set(
            (
                await db.execute(
                    select(Group.id)
                    .where(Group.id.in_(group_ids))
                    .with_for_update(skip_locked=True, key_share=True)
                )
            ).scalars()
        )
    wanted = [u for u in units if u.group_id is None or u.group_id in locked_groups]
    ids = [i for u in wanted for i in u.ids]
    if not ids:
        return []
    got = set(
        (
            await db.execute(
                select(Trajectory.id)
                .where(Trajectory.id.in_(ids), _claimable(Trajectory, filt))
                .with_for_update(skip_locked=True)
            )
        ).scalars()
    )
    return [i for u in wanted if got.issuperset(u.ids) for i in u.ids]


async def _load_samples(db: AsyncSession, ids: Sequence[int]) -> tuple[TrainingSample, ...]:
    rows = (
        await db.execute(select(Trajectory).where(Trajectory.id.in_(ids)).order_by(Trajectory.id))
    ).scalars()
    return tuple(
        TrainingSample(
            trajectory_id=t.id,
            token_ids=t.token_ids,
            loss_mask=t.loss_mask,
            logprobs=t.logprobs,
            versions=t.versions,
            reward=t.reward,
            group_id=t.group_id,
            temperature=t.temperature,
            baseline_key=t.baseline_key,
        )
        for t in rows
    )
