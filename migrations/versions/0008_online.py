"""Online training: eval-gated policy versions, user feedback, conversation hints and retry orphans.

- policy_versions: `status` (candidate, promoted, rejected), the version it was trained from
  (`parent_version`), its evaluation (`eval_score`, `eval_details`), why it was promoted or rejected
  (`reason`), and when it was last put on the serving workers (`served_at`). Existing rows were all
  served: they become promoted, served when they were created.
- feedback: one user judgement (a value, a thumbs, a comment) of one completion, and whether it joined
  training (`applied`) or came too late (`late`).
- sessions.conversation: the conversation hint an online key's calls carried.
- completions.orphan_of: a retried call nobody continued from, and the completion the conversation
  continued from instead.
- trajectories.completion_ids and baseline_key: the completions a sample was built from (so late
  feedback can reach it) and the key of its running reward baseline.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

Written by hand: nullable columns (or with server defaults) and one new table.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON(none_as_null=True)  # as in 0001: `json` on Postgres
TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Plain ALTER TABLE on both backends: a batch (table copy) on SQLite would break the trigger on sessions.
    op.add_column(
        "policy_versions", sa.Column("status", sa.String(length=16), server_default="promoted", nullable=False)
    )
    op.add_column("policy_versions", sa.Column("parent_version", sa.Integer(), nullable=True))
    op.add_column("policy_versions", sa.Column("eval_score", sa.Double(), nullable=True))
    op.add_column("policy_versions", sa.Column("eval_details", JSON, nullable=True))
    op.add_column("policy_versions", sa.Column("reason", sa.Text(), nullable=True))
    op.add_column("policy_versions", sa.Column("served_at", TIMESTAMP, nullable=True))
    op.execute("UPDATE policy_versions SET served_at = created_at")
    op.add_column("sessions", sa.Column("conversation", sa.String(length=128), nullable=True))
    op.create_index("ix_sessions_owner_conversation", "sessions", ["owner_key_hash", "conversation"])
    op.add_column("completions", sa.Column("orphan_of", sa.String(length=64), nullable=True))
    op.add_column("trajectories", sa.Column("completion_ids", JSON, nullable=True))
    op.add_column("trajectories", sa.Column("baseline_key", sa.String(length=64), nullable=True))
    op.create_table(
        "feedback",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("completion_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("thumbs", sa.String(length=4), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reward_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("created_at", TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("state IN ('applied', 'late')", name=op.f("ck_feedback_state_known")),
        sa.CheckConstraint("thumbs IS NULL OR thumbs IN ('up', 'down')", name=op.f("ck_feedback_thumbs_known")),
        sa.CheckConstraint("value BETWEEN -1e308 AND 1e308", name=op.f("ck_feedback_value_finite")),
        sa.ForeignKeyConstraint(
            ["completion_id"], ["completions.id"], name=op.f("fk_feedback_completion_id_completions")
        ),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_feedback_session_id_sessions")),
        sa.ForeignKeyConstraint(["reward_id"], ["rewards.id"], name=op.f("fk_feedback_reward_id_rewards")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback")),
    )
    op.create_index("ix_feedback_completion_id", "feedback", ["completion_id"])
    op.create_index("ix_feedback_session_id", "feedback", ["session_id"])


def downgrade() -> None:
    op.drop_table("feedback")
    op.drop_index("ix_sessions_owner_conversation", table_name="sessions")
    # SQLite (3.35 and newer) and Postgres both drop a plain column in place.
    for table, column in (
        ("trajectories", "baseline_key"),
        ("trajectories", "completion_ids"),
        ("completions", "orphan_of"),
        ("sessions", "conversation"),
        ("policy_versions", "served_at"),
        ("policy_versions", "reason"),
        ("policy_versions", "eval_details"),
        ("policy_versions", "eval_score"),
        ("policy_versions", "parent_version"),
        ("policy_versions", "status"),
    ):
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
