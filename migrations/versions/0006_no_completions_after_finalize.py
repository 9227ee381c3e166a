"""No completion joins a finalized session: a trigger on completions refuses an insert into a session
whose trajectories are written (the call that made it then fails instead of its completion being left
out of training unseen).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

Written by hand: SQLite and Postgres spell triggers differently. On Postgres the trigger reads the
session's status FOR SHARE, so an insert racing the finalizer's transaction (which holds the session
row) waits for it and then sees the session finalized. On SQLite writers are serialized anyway.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MESSAGE = "session_finalized: its trajectories are written, so no completion may join it"

_POSTGRES_FUNCTION = f"""
CREATE FUNCTION completions_refuse_finalized_session() RETURNS trigger AS $$
BEGIN
    IF (SELECT status FROM sessions WHERE id = NEW.session_id FOR SHARE) = 'finalized' THEN
        RAISE EXCEPTION '{MESSAGE}' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$ LANGUAGE plpgsql
"""
_POSTGRES_TRIGGER = """
CREATE TRIGGER completions_refuse_finalized_session BEFORE INSERT ON completions
FOR EACH ROW EXECUTE FUNCTION completions_refuse_finalized_session()
"""
_SQLITE_TRIGGER = f"""
CREATE TRIGGER completions_refuse_finalized_session BEFORE INSERT ON completions
WHEN (SELECT status FROM sessions WHERE id = NEW.session_id) = 'finalized'
BEGIN
    SELECT RAISE(ABORT, '{MESSAGE}');
END
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_POSTGRES_FUNCTION)
        op.execute(_POSTGRES_TRIGGER)
    else:
        op.execute(_SQLITE_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS completions_refuse_finalized_session"
               + (" ON completions" if op.get_bind().dialect.name == "postgresql" else ""))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS completions_refuse_finalized_session()")
