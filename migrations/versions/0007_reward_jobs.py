"""Reward hooks: the hooks each session and group is labelled by (sessions.reward_hooks,
groups.reward_hooks), and the durable queue of hook jobs (reward_jobs).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Written by hand: two nullable columns and one new table; existing rows need no change (NULL: no hooks).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON(none_as_null=True)  # as in 0001: `json` on Postgres
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: a batch (table copy) on SQLite would break the trigger on sessions.
    op.add_column("sessions", sa.Column("reward_hooks", JSON, nullable=True))
    op.add_column("groups", sa.Column("reward_hooks", JSON, nullable=True))
    op.create_table(
        "reward_jobs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=True),
        sa.Column("group_id", sa.String(length=64), nullable=True),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("spec", JSON, nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("run_after", TIMESTAMP, nullable=False),
        sa.Column("lease_token", sa.String(length=36), nullable=True),
        sa.Column("lease_until", TIMESTAMP, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("result", JSON, nullable=True),
        sa.Column("created_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint(
            "(session_id IS NULL AND group_id IS NOT NULL) OR (session_id IS NOT NULL AND group_id IS NULL)",
            name=op.f("ck_reward_jobs_one_subject"),
        ),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_reward_jobs_state_known")
        ),
        sa.ForeignKeyConstraint(["group_id"], ["groups.id"], name=op.f("fk_reward_jobs_group_id_groups")),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_reward_jobs_session_id_sessions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reward_jobs")),
    )
    op.create_index("ix_reward_jobs_state_run_after", "reward_jobs", ["state", "run_after"])
    op.create_index("ux_reward_jobs_group_source", "reward_jobs", ["group_id", "source"], unique=True)
    op.create_index("ux_reward_jobs_session_source", "reward_jobs", ["session_id", "source"], unique=True)


def downgrade() -> None:
    op.drop_table("reward_jobs")
    # SQLite (3.35 and newer) and Postgres both drop a plain column in place.
    op.execute("ALTER TABLE groups DROP COLUMN reward_hooks")
    op.execute("ALTER TABLE sessions DROP COLUMN reward_hooks")
