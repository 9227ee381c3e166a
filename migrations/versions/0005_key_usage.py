"""Daily token usage per API key (key_usage): what the proxy's per-key token quotas count, shared by
every proxy on the database.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Written by hand: one new table, nothing else changes.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "key_usage",
        sa.Column("key_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("tokens >= 0", name=op.f("ck_key_usage_tokens_not_negative")),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], name=op.f("fk_key_usage_key_id_api_keys")),
        sa.PrimaryKeyConstraint("key_id", "day", name=op.f("pk_key_usage")),
    )


def downgrade() -> None:
    op.drop_table("key_usage")
