"""Admission control and stale samples (docs/architecture.md, "Admission control").

- sessions.holds_slot: the session holds one of the RL API's admission slots (opened through the RL
  API and not known untrainable), with a partial index of those, which admission counts. Existing
  sessions the RL API opened (no owning online key) hold one while they are not finalized or have a
  trajectory: admission then counts a run upgraded midway as it would have from its start (the proxy's
  one-off admin-call sessions are finalized without trajectories, so they hold none).
- trajectories.dropped_at: a sample a claim found older than η (or in a group with such a member) and
  dropped; the claim index leaves dropped rows out.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Written by hand: columns with server defaults (or nullable), a backfill and two partial indexes.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)

_BACKFILL = """
UPDATE sessions SET holds_slot = {true}
WHERE owner_key_hash IS NULL
  AND (status <> 'finalized' OR EXISTS (SELECT 1 FROM trajectories t WHERE t.session_id = sessions.id))
"""


def _unconsumed_index(where: str) -> None:
    op.create_index(
        "ix_trajectories_unconsumed",
        "trajectories",
        ["min_version", "id"],
        unique=False,
        sqlite_where=sa.text(where),
        postgresql_where=sa.text(where),
    )


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: a batch (table copy) on SQLite would break the tables' triggers.
    op.add_column("sessions", sa.Column("holds_slot", sa.Boolean(), server_default=sa.false(), nullable=False))
    postgres = op.get_bind().dialect.name == "postgresql"
    op.execute(_BACKFILL.format(true="true" if postgres else "1"))
    op.create_index(
        "ix_sessions_holds_slot",
        "sessions",
        ["holds_slot"],
        unique=False,
        sqlite_where=sa.text("holds_slot = 1"),
        postgresql_where=sa.text("holds_slot"),
    )
    op.add_column("trajectories", sa.Column("dropped_at", TIMESTAMP, nullable=True))
    op.drop_index("ix_trajectories_unconsumed", table_name="trajectories")
    _unconsumed_index("consumed_step IS NULL AND dropped_at IS NULL")


def downgrade() -> None:
    op.drop_index("ix_trajectories_unconsumed", table_name="trajectories")
    _unconsumed_index("consumed_step IS NULL")
    op.drop_index("ix_sessions_holds_slot", table_name="sessions")
    # SQLite (3.35 and newer) and Postgres both drop a plain column in place.
    op.execute("ALTER TABLE trajectories DROP COLUMN dropped_at")
    op.execute("ALTER TABLE sessions DROP COLUMN holds_slot")
