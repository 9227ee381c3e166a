"""Ephemeral context: `completions.dropped_messages`, how many trailing messages of its parent's request a
call left out and still extended it (an agent's temporary context, re-sent fresh on every request), so a
conversation tree rebuilt from the records matches the agent's next call the same way.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

Written by hand: one column with a server default.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: a batch (table copy) on SQLite would break the table's triggers.
    op.add_column(
        "completions", sa.Column("dropped_messages", sa.Integer(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.execute("ALTER TABLE completions DROP COLUMN dropped_messages")
