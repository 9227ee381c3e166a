"""Online keys: api_keys.scope 'online' (a long-lived key without a session of its own) and
sessions.owner_key_hash (the online key whose calls made a session; they join it while it is active).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Written by hand. SQLite cannot alter a check constraint in place, so api_keys is rebuilt in batch mode
(a table copy; it holds only keys). The downgrade deletes online keys first: the old constraint
refuses them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "(scope = 'admin' AND session_id IS NULL) OR (scope = 'session' AND session_id IS NOT NULL)"
_NEW = _OLD + " OR (scope = 'online' AND session_id IS NULL)"


def _scope_check(condition: str) -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint(op.f("ck_api_keys_scope_matches_session"), type_="check")
        batch.create_check_constraint("scope_matches_session", condition)


def upgrade() -> None:
    _scope_check(_NEW)
    op.add_column("sessions", sa.Column("owner_key_hash", sa.String(length=64), nullable=True))
    op.create_index(op.f("ix_sessions_owner_key_hash"), "sessions", ["owner_key_hash"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_sessions_owner_key_hash"), table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("owner_key_hash")
    op.execute("DELETE FROM api_keys WHERE scope = 'online'")
    _scope_check(_OLD)
