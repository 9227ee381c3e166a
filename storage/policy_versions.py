"""Policy versions and their promotion: which version is served, which is the best, which are candidates.

Without promotion gating every version the trainer records is promoted and served at once. With it, a
new version is recorded as a candidate (its training step and consumed samples in the same transaction,
storage/claims.py `record_step`), evaluated, then promoted (and served) or rejected here. The best version
is the promoted one with the highest eval score (the newest on a tie; without any score, the newest
promoted); the served one is the promoted version the workers started serving last.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, select, update

from storage.engine import SessionFactory, write_transaction
from storage.models import PolicyVersion, VersionStatus, as_utc
from storage.records import EvalResult


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionInfo:
    """One row of policy_versions."""

    version: int
    status: str
    checkpoint_path: str
    parent_version: int | None
    eval_score: float | None
    item_scores: dict[str, float]
    reason: str | None
    served_at: datetime | None
    created_at: datetime

    @property
    def evaluation(self) -> EvalResult | None:
        """Its eval result, when it was evaluated."""
        if self.eval_score is None:
            return None
        return EvalResult(score=self.eval_score, item_scores=dict(self.item_scores))

    def as_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "status": self.status,
            "parent_version": self.parent_version,
            "eval_score": self.eval_score,
            "reason": self.reason,
            "served_at": None if self.served_at is None else as_utc(self.served_at).isoformat(),
            "created_at": as_utc(self.created_at).isoformat(),
        }


def _info(row: PolicyVersion) -> VersionInfo:
    details = row.eval_details or {}
    return VersionInfo(
        version=row.version,
        status=row.status,
        checkpoint_path=row.checkpoint_path,
        parent_version=row.parent_version,
        eval_score=row.eval_score,
        item_scores={str(k): float(v) for k, v in (details.get("items") or {}).items()},
        reason=row.reason,
        served_at=row.served_at,
        created_at=row.created_at,
    )


def _eval_details(result: EvalResult) -> dict[str, Any]:
    return {**result.details, "items": dict(result.item_scores)}


async def version_info(session_factory: SessionFactory, version: int) -> VersionInfo | None:
    async with session_factory() as db:
        row = await db.get(PolicyVersion, version)
        return None if row is None else _info(row)


async def best_version(session_factory: SessionFactory) -> VersionInfo | None:
    """The promoted version with the highest eval score (the newest on a tie); the newest promoted one when
    none has a score; None before any version is recorded."""
    promoted = PolicyVersion.status == VersionStatus.PROMOTED.value
    query = (
        select(PolicyVersion)
        .where(promoted)
        .order_by(PolicyVersion.eval_score.desc().nulls_last(), PolicyVersion.version.desc())
        .limit(1)
    )
    async with session_factory() as db:
        row = await db.scalar(query)
        return None if row is None else _info(row)


async def served_version(session_factory: SessionFactory) -> VersionInfo | None:
    """The version the serving workers started serving last; None before any."""
    query = (
        select(PolicyVersion)
        .where(PolicyVersion.served_at.is_not(None))
        .order_by(PolicyVersion.served_at.desc(), PolicyVersion.version.desc())
        .limit(1)
    )
    async with session_factory() as db:
        row = await db.scalar(query)
        return None if row is None else _info(row)


async def newest_version(session_factory: SessionFactory) -> VersionInfo | None:
    """The newest version recorded, whatever its status."""
    async with session_factory() as db:
        row = await db.scalar(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(1))
        return None if row is None else _info(row)


async def next_version(session_factory: SessionFactory) -> int:
    """The number the next trained version takes: one past every version recorded, rejected ones too
    (version 0, the initial weights, may have no row)."""
    async with session_factory() as db:
        newest = await db.scalar(select(func.max(PolicyVersion.version)))
    return 1 if newest is None else newest + 1


async def record_initial(session_factory: SessionFactory, checkpoint_path: str, result: EvalResult) -> None:
    """Version 0 (the initial weights), evaluated: promoted and served, the first best version. A no-op
    when version 0 has a row already."""
    async with write_transaction(session_factory) as db:
        if await db.get(PolicyVersion, 0) is not None:
            return
        await db.execute(
            insert(PolicyVersion).values(
                version=0,
                checkpoint_path=checkpoint_path,
                status=VersionStatus.PROMOTED.value,
                eval_score=result.score,
                eval_details=_eval_details(result),
                reason="the initial weights",
                served_at=datetime.now(UTC),
            )
        )


async def settle(
    session_factory: SessionFactory,
    version: int,
    *,
    promoted: bool,
    result: EvalResult | None,
    reason: str,
    served: bool = False,
) -> None:
    """A candidate's verdict: promoted or rejected, with its evaluation and why; `served`: the serving
    workers already serve it (a promoted version is pushed before it is recorded promoted). Refuses
    (ValueError) a version that is not a candidate, so a verdict is given once."""
    status = VersionStatus.PROMOTED if promoted else VersionStatus.REJECTED
    values: dict[str, Any] = {"status": status.value, "reason": reason}
    if promoted and served:
        values["served_at"] = datetime.now(UTC)
    if result is not None:
        values.update(eval_score=result.score, eval_details=_eval_details(result))
    async with write_transaction(session_factory) as db:
        updated = await db.execute(
            update(PolicyVersion)
            .where(PolicyVersion.version == version, PolicyVersion.status == VersionStatus.CANDIDATE.value)
            .values(**values)
            .returning(PolicyVersion.version)
        )
        if updated.one_or_none() is None:
            raise ValueError(f"policy version {version} is not a candidate")


async def record_evaluation(session_factory: SessionFactory, version: int, result: EvalResult) -> None:
    """The evaluation of a version promoted before gating was turned on (it becomes comparable)."""
    async with write_transaction(session_factory) as db:
        await db.execute(
            update(PolicyVersion)
            .where(PolicyVersion.version == version)
            .values(eval_score=result.score, eval_details=_eval_details(result))
        )


async def candidates(session_factory: SessionFactory) -> list[VersionInfo]:
    """Versions still waiting for a verdict (the trainer stopped while evaluating them), oldest first."""
    query = select(PolicyVersion).where(PolicyVersion.status == VersionStatus.CANDIDATE.value)
    async with session_factory() as db:
        rows = (await db.scalars(query.order_by(PolicyVersion.version))).all()
        return [_info(row) for row in rows]


async def mark_served(session_factory: SessionFactory, version: int) -> None:
    """The serving workers now serve `version` (promoted): it becomes the served version."""
    async with write_transaction(session_factory) as db:
        updated = await db.execute(
            update(PolicyVersion)
            .where(PolicyVersion.version == version, PolicyVersion.status == VersionStatus.PROMOTED.value)
            .values(served_at=datetime.now(UTC))
            .returning(PolicyVersion.version)
        )
        if updated.one_or_none() is None:
            raise ValueError(f"policy version {version} is not promoted: it may not be served")


async def protected_versions(session_factory: SessionFactory) -> set[int]:
    """Versions whose checkpoints must stay on disk: the served one, the best one, and every candidate
    (being evaluated, or waiting for it after a restart)."""
    waiting = {info.version for info in await candidates(session_factory)}
    served, best = await served_version(session_factory), await best_version(session_factory)
    return waiting | {info.version for info in (served, best) if info is not None}
