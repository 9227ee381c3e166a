"""What the proxy and the session finalizer write and read: keys, groups, sessions, completions, rewards,
trajectories. The trainer's claim and step functions live in storage/claims.py (re-exported here)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from storage.admission import Admits, admit
from storage.claims import ClaimLostError, claim_batch, latest_policy_version, record_step, release_claim
from storage.engine import SessionFactory, affected_rows, write_transaction
from storage.keys import NO_KEY_LIMITS, KeyLimits
from storage.models import (
    ApiKey,
    Completion,
    Group,
    KeyScope,
    Reward,
    Session,
    SessionStatus,
    Trajectory,
)
from storage.online_sessions import claim_hint
from storage.records import (
    ApiKeyRecord,
    CompletionRecord,
    GroupRecord,
    SessionRecord,
    TrajectoryRecord,
)
from storage.reward_jobs import queue_jobs_on_end
from storage.reward_writes import SessionFinalizedError, add_reward, rewards_of

__all__ = [
    "ClaimLostError",
    "SessionChangedError",
    "SessionFinalizedError",
    "active_owned_sessions",
    "add_reward",
    "claim_batch",
    "completion_record",
    "create_admin_key",
    "create_group",
    "create_online_key",
    "create_session",
    "end_session",
    "find_api_key",
    "insert_trajectories",
    "latest_policy_version",
    "load_completion_chain",
    "load_session_completions",
    "record_completion",
    "record_completions",
    "record_step",
    "release_claim",
    "session_owner",
]


async def create_admin_key(
    session_factory: SessionFactory, key_hash: str, limits: KeyLimits = NO_KEY_LIMITS
) -> None:
    """An admin key, stored as its keyed hash (storage/keys.py: `KeyHasher`), with its own `limits`."""
    async with write_transaction(session_factory) as db:
        db.add(_key_row(key_hash, KeyScope.ADMIN, limits))


async def create_online_key(
    session_factory: SessionFactory, key_hash: str, limits: KeyLimits = NO_KEY_LIMITS
) -> None:
    """A long-lived key without a session: its calls join the sessions it owns by conversation."""
    async with write_transaction(session_factory) as db:
        db.add(_key_row(key_hash, KeyScope.ONLINE, limits))


def _key_row(key_hash: str, scope: KeyScope, limits: KeyLimits) -> ApiKey:
    return ApiKey(key_hash=key_hash, scope=scope.value, session_id=None, requests_per_s=limits.requests_per_s,
                  burst=limits.burst, tokens_per_day=limits.tokens_per_day)


async def active_owned_sessions(
    session_factory: SessionFactory, owner_key_hash: str, among: Collection[str] | None = None
) -> list[str]:
    """The active sessions an online key's calls made without a conversation hint (of `among` only, when
    given), newest first: the sessions its unhinted calls may join by their messages."""
    query = (
        select(Session.id)
        .where(Session.owner_key_hash == owner_key_hash, Session.status == SessionStatus.ACTIVE.value,
               Session.conversation.is_(None))
        .order_by(Session.created_at.desc(), Session.id)
    )
    if among is not None:
        query = query.where(Session.id.in_(list(among)))
    async with session_factory() as db:
        return list((await db.execute(query)).scalars())


async def session_owner(session_factory: SessionFactory, session_id: str) -> str | None:
    """The online key hash that owns a session (None: no such session, or not an online one)."""
    async with session_factory() as db:
        return await db.scalar(select(Session.owner_key_hash).where(Session.id == session_id))


async def find_api_key(session_factory: SessionFactory, key_hash: str) -> ApiKeyRecord | None:
    """The unrevoked key with this hash, or None."""
    async with session_factory() as db:
        row = (
            await db.execute(
                select(ApiKey.scope, ApiKey.session_id).where(
                    ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None)
                )
            )
        ).one_or_none()
    return None if row is None else ApiKeyRecord(scope=row.scope, session_id=row.session_id)


async def create_group(
    session_factory: SessionFactory, group: GroupRecord, sessions: Sequence[SessionRecord] = (),
    admits: Admits | None = None,
) -> None:
    """A group and, in the same transaction, any of its sessions already known (at most `group.size`).
    `admits`: first check admission for the sessions (storage/admission.py; AdmissionRefused)."""
    if group.size < 1:
        raise ValueError(f"group size must be at least 1, got {group.size}")
    async with write_transaction(session_factory) as db:
        if admits is not None:
            await admit(db, len(sessions), admits)
        db.add(Group(id=group.id, size=group.size, task=group.task, reward_hooks=group.reward_hooks or None))
        await db.flush()
        await _add_sessions(db, sessions)


async def create_session(
    session_factory: SessionFactory, session: SessionRecord, admits: Admits | None = None
) -> None:
    """A session and its session key; joining a group that already has `size` sessions is a ValueError.
    `admits`: first check admission for it (storage/admission.py; AdmissionRefused). An online key's
    session with a conversation hint is refused with ConversationTaken while the key has an active one
    with that hint (storage/online_sessions.py), whichever process made it."""
    async with write_transaction(session_factory) as db:
        if admits is not None:
            await admit(db, 1, admits)
        if session.owner_key_hash is not None and session.conversation is not None:
            await claim_hint(db, session.owner_key_hash, session.conversation)
        await _add_sessions(db, [session])


async def _add_sessions(db: AsyncSession, sessions: Sequence[SessionRecord]) -> None:
    for group_id in {s.group_id for s in sessions if s.group_id is not None}:
        joining = sum(1 for s in sessions if s.group_id == group_id)
        await _check_group_room(db, group_id, joining)
    for s in sessions:
        db.add(Session(id=s.id, group_id=s.group_id, task=s.task, metadata_=dict(s.metadata),
                       owner_key_hash=s.owner_key_hash, reward_hooks=s.reward_hooks or None,
                       conversation=s.conversation, holds_slot=s.admitted))
    await db.flush()  # sessions before the keys that point at them
    for s in sessions:
        db.add(ApiKey(key_hash=s.key_hash, scope=KeyScope.SESSION.value, session_id=s.id))
    await db.flush()


async def _check_group_room(db: AsyncSession, group_id: str, joining: int) -> None:
    # The row lock makes concurrent joins on Postgres count one after another (SQLite: BEGIN IMMEDIATE).
    size = (
        await db.execute(select(Group.size).where(Group.id == group_id).with_for_update())
    ).scalar_one_or_none()
    if size is None:
        raise LookupError(f"no group {group_id!r}")
    members = (
        await db.execute(select(func.count()).select_from(Session).where(Session.group_id == group_id))
    ).scalar_one()
    if members + joining > size:
        raise ValueError(f"group {group_id!r} has {members} of {size} sessions; {joining} more do not fit")


async def end_session(session_factory: SessionFactory, session_id: str) -> bool:
    """Mark an active session ended and, in the same transaction, queue its reward hooks' jobs (and its
    group's, when it was the group's last session to end). False if it had already ended; LookupError if
    there is none."""
    async with write_transaction(session_factory) as db:
        row = (await db.execute(select(Session.group_id, Session.reward_hooks)
                                .where(Session.id == session_id))).one_or_none()
        if row is None:
            raise LookupError(f"no session {session_id!r}")
        group_id, hooks = row
        if group_id is not None:  # ends in one group take turns, so exactly one sees the group complete
            await db.execute(select(Group.id).where(Group.id == group_id).with_for_update())
        result = await db.execute(
            update(Session)
            .where(Session.id == session_id, Session.status == SessionStatus.ACTIVE.value)
            .values(status=SessionStatus.ENDED.value, ended_at=datetime.now(UTC))
        )
        if affected_rows(result) == 1:
            await queue_jobs_on_end(db, session_id, hooks, group_id)
            return True
    return False


async def record_completion(session_factory: SessionFactory, record: CompletionRecord) -> None:
    await record_completions(session_factory, [record])


async def record_completions(session_factory: SessionFactory, records: Sequence[CompletionRecord]) -> None:
    """Write completions in one transaction (the proxy's group commit). A parent must be written before,
    or earlier in `records` than, its children."""
    rows = [_completion_row(record) for record in records]
    if not rows:
        return
    async with write_transaction(session_factory) as db:
        await db.execute(insert(Completion), rows)


def _completion_row(record: CompletionRecord) -> dict[str, Any]:
    n_out = {len(record.output_ids), len(record.output_logprobs), len(record.output_versions)}
    if len(n_out) != 1:
        raise ValueError(
            f"completion {record.id}: output_ids, output_logprobs and output_versions differ in length"
        )
    return {
        "id": record.id,
        "session_id": record.session_id,
        "parent_id": record.parent_id,
        "prompt_ids": record.prompt_ids,
        "output_ids": record.output_ids,
        "output_logprobs": record.output_logprobs,
        "output_versions": record.output_versions,
        "finish_reason": record.finish_reason,
        "temperature": record.temperature,
        "top_p": record.top_p,
        "top_k": record.top_k,
        "branched": record.branched,
        "orphan_of": record.orphan_of,
        "dropped_messages": record.dropped_messages,
        "request_json": record.request_json,
        "response_json": record.response_json,
    }


class SessionChangedError(RuntimeError):
    """A completion or a reward joined the session after its trajectories were built: build them again."""


async def insert_trajectories(
    session_factory: SessionFactory, session_id: str, trajectories: Sequence[TrajectoryRecord],
    completions: int | None = None, orphans: Mapping[str, str] | None = None, rewards: int | None = None,
) -> list[int]:
    """Write a session's trajectories and mark it finalized, in one transaction, so a claimer never sees a
    finalized session without its trajectories. An empty list finalizes a rejected session. Returns the
    new ids, in order. A session already finalized is a ValueError; an unknown one a LookupError.
    `completions`: how many the trajectories were built from; if the session has more by now (a call
    recorded since), nothing is written and SessionChangedError says to build them again. From this
    transaction on no completion can join the session (a trigger refuses it: migration 0006).
    `orphans`: the session's retry orphans, each marked `orphan_of` the completion kept in its stead, in
    the same transaction (rewards/orphans.py).
    `rewards`: how many rewards (on the session and its completions) they were built from; a reward
    written since (by another process: rewards are only ever added) is a SessionChangedError too. Both
    counts are read after the session's row is updated, so a writer that had locked it first (a
    completion's trigger, `add_reward`, feedback) has committed and is counted, and any later one sees
    the session finalized."""
    rows = [_trajectory_row(t) for t in trajectories]
    async with write_transaction(session_factory) as db:
        group_id, baseline_key = await _finalize(db, session_id)
        if completions is not None:
            now = await db.scalar(
                select(func.count()).select_from(Completion).where(Completion.session_id == session_id)
            )
            if now != completions:
                raise SessionChangedError(f"session {session_id} has {now} completions, not {completions}")
        if rewards is not None:
            now = await db.scalar(select(func.count()).select_from(Reward).where(rewards_of(session_id)))
            if now != rewards:
                raise SessionChangedError(f"session {session_id} has {now} rewards, not {rewards}")
        for orphan_id, kept_id in (orphans or {}).items():  # a few at most: one statement each
            await db.execute(update(Completion)
                             .where(Completion.id == orphan_id, Completion.session_id == session_id)
                             .values(orphan_of=kept_id))
        if not rows:  # untrainable: its admission slot, if it held one, is free again
            await db.execute(update(Session).where(Session.id == session_id).values(holds_slot=False))
            return []
        for row in rows:
            row.update(session_id=session_id, group_id=group_id, baseline_key=baseline_key)
        result = await db.execute(
            insert(Trajectory).returning(Trajectory.id, sort_by_parameter_order=True), rows
        )
        return list(result.scalars())


async def _finalize(db: AsyncSession, session_id: str) -> tuple[str | None, str | None]:
    """Mark the session finalized; its group and the baseline key of its samples."""
    now = datetime.now(UTC)
    result = await db.execute(
        update(Session)
        .where(Session.id == session_id, Session.status != SessionStatus.FINALIZED.value)
        .values(status=SessionStatus.FINALIZED.value, ended_at=func.coalesce(Session.ended_at, now))
        .returning(Session.group_id, Session.task, Session.owner_key_hash)
    )
    row = result.one_or_none()
    if row is not None:
        return row.group_id, baseline_key(row.task, row.owner_key_hash)
    if await db.scalar(select(literal(1)).where(Session.id == session_id)) is None:
        raise LookupError(f"no session {session_id!r}")
    raise ValueError(f"session {session_id!r} is already finalized")


def baseline_key(task: Any, owner_key_hash: str | None) -> str | None:
    """The running-baseline key of a session's samples: its task (a digest of its canonical JSON), else
    the online key that made it; None when it has neither (the batch is its baseline)."""
    if task is not None:
        canonical = json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return "task:" + hashlib.sha256(canonical.encode()).hexdigest()[:40]
    if owner_key_hash is not None:
        return "key:" + owner_key_hash[:40]
    return None


def _trajectory_row(t: TrajectoryRecord) -> dict[str, Any]:
    lengths = {len(t.token_ids), len(t.loss_mask), len(t.logprobs), len(t.versions)}
    if len(lengths) != 1:
        raise ValueError("token_ids, loss_mask, logprobs and versions differ in length")
    if not math.isfinite(t.reward):
        raise ValueError(f"trajectory reward must be finite, got {t.reward!r}")
    versions = np.asarray(t.versions)
    generated = versions[versions >= 0]
    if generated.size == 0:
        raise ValueError("a trajectory needs at least one generated token (a version >= 0)")
    return {
        "token_ids": t.token_ids,
        "loss_mask": t.loss_mask,
        "logprobs": t.logprobs,
        "versions": t.versions,
        "reward": float(t.reward),
        "temperature": float(t.temperature),
        "min_version": int(generated.min()),
        "completion_ids": list(t.completion_ids) or None,
    }


async def load_completion_chain(
    session_factory: SessionFactory, completion_id: str
) -> list[CompletionRecord]:
    """A completion and its ancestors, root first (one recursive query); rebuild full token sequences
    from it with storage.sequences. Empty if there is no such completion."""
    chain = (
        select(Completion.id, Completion.parent_id, literal(0).label("depth"))
        .where(Completion.id == completion_id)
        .cte("chain", recursive=True)
    )
    parent = aliased(Completion)
    chain = chain.union_all(
        select(parent.id, parent.parent_id, chain.c.depth + 1).where(parent.id == chain.c.parent_id)
    )
    query = select(Completion).join(chain, Completion.id == chain.c.id).order_by(chain.c.depth.desc())
    async with session_factory() as db:
        completions = (await db.execute(query)).scalars().all()
    return [completion_record(c) for c in completions]


def completion_record(c: Completion) -> CompletionRecord:
    """The narrow record of a stored completion row."""
    return CompletionRecord(
        id=c.id,
        session_id=c.session_id,
        parent_id=c.parent_id,
        prompt_ids=c.prompt_ids,
        output_ids=c.output_ids,
        output_logprobs=c.output_logprobs,
        output_versions=c.output_versions,
        finish_reason=c.finish_reason,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        branched=c.branched,
        orphan_of=c.orphan_of,
        dropped_messages=c.dropped_messages,
        request_json=c.request_json,
        response_json=c.response_json,
    )


async def load_session_completions(
    session_factory: SessionFactory, session_id: str
) -> list[CompletionRecord]:
    """A session's completions in call order (created_at, then id): parents before their children,
    each with only its own suffix and new messages (rebuild chains with storage.sequences)."""
    query = (
        select(Completion)
        .where(Completion.session_id == session_id)
        .order_by(Completion.created_at, Completion.id)
    )
    async with session_factory() as db:
        completions = (await db.execute(query)).scalars().all()
    return [completion_record(c) for c in completions]
