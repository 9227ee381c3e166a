"""trajectories.temperature: the sampling temperature of a trajectory's generated tokens, so the trainer
computes its logprobs at the temperature they were sampled with (docs/architecture.md, "The token-exact
rule").

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Written by hand. Rows written before this revision were sampled at the proxy's default, 1.0.
SQLite >= 3.35 drops a column natively, and this one is in no index or constraint, so the downgrade
needs no table copy.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "trajectories",
        sa.Column("temperature", sa.Double(), server_default=sa.text("1.0"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("trajectories", "temperature")
