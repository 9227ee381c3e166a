"""Admission control's side of storage (docs/architecture.md, "Admission control"): how many sessions
hold an RL API admission slot, and the newest policy version, read in the transaction that creates the
sessions asking for slots, so that the rule (proxy/rl/admission.py) is checked and the sessions written
at once.

A session holds a slot (`sessions.holds_slot`) from its creation through the RL API until it is known
untrainable: finalized without trajectories (`storage/queries.py`), or every trajectory of it dropped
as stale (`release_slots`, from storage/claims.py). Sessions consumed by training keep theirs: the count
is cumulative, as the capacity it is held to grows with each policy version. Creations are serialised
(BEGIN IMMEDIATE on SQLite, a transaction-scoped advisory lock on Postgres), so concurrent requests
never admit past the capacity together.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from sqlalchemy import exists, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory, affected_rows
from storage.models import PolicyVersion, Session, Trajectory

_ADMISSION_LOCK = 0x46_6C_79_41_64_6D_69_74  # a fixed pg_advisory_xact_lock key ("FlyAdmit")


@dataclass(frozen=True, slots=True)
class AdmissionState:
    """What admission is decided on: sessions holding a slot, and the newest recorded policy version
    (0 before the first step)."""

    admitted: int
    version: int


Admits = Callable[[AdmissionState, int], bool]
"""The rule: whether `joining` more sessions may be admitted in this state."""


class AdmissionRefused(Exception):
    """Admitting `joining` sessions would break the rule in `state`; nothing was written."""

    def __init__(self, state: AdmissionState, joining: int) -> None:
        super().__init__(
            f"{joining} more sessions refused: {state.admitted} hold a slot at version {state.version}"
        )
        self.state = state
        self.joining = joining


async def admission_state(db: AsyncSession) -> AdmissionState:
    """One statement: the sessions holding a slot (a count over their partial index) and the newest
    policy version (the primary key's maximum)."""
    slots = select(func.count()).select_from(Session).where(Session.holds_slot == True).scalar_subquery()  # noqa: E712
    newest = select(func.max(PolicyVersion.version)).scalar_subquery()
    row = (await db.execute(select(slots, newest))).one()
    return AdmissionState(admitted=int(row[0]), version=int(row[1] or 0))


async def read_admission(session_factory: SessionFactory) -> AdmissionState:
    """The admission state as of now (outside any creation)."""
    async with session_factory() as db:
        return await admission_state(db)


async def admit(db: AsyncSession, joining: int, admits: Admits) -> AdmissionState:
    """In the creating transaction `db`: wait for the other creations, read the state, and raise
    AdmissionRefused unless `admits(state, joining)`. Returns the state admitted on."""
    if db.get_bind().dialect.name == "postgresql":
        await db.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADMISSION_LOCK})
    state = await admission_state(db)
    if not admits(state, joining):
        raise AdmissionRefused(state, joining)
    return state


async def release_slots(db: AsyncSession, session_ids: Collection[str]) -> int:
    """Free the slots of those of `session_ids` that have no trajectory left that may be trained (every
    one dropped); returns how many were freed."""
    if not session_ids:
        return 0
    live = exists().where(Trajectory.session_id == Session.id, Trajectory.dropped_at.is_(None))
    result = await db.execute(
        update(Session)
        .where(Session.id.in_(list(session_ids)), Session.holds_slot == True, ~live)  # noqa: E712
        .values(holds_slot=False)
    )
    return affected_rows(result)
