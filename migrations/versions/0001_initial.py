"""Initial schema: api_keys, groups, sessions, completions, rewards, trajectories, policy_versions,
train_steps (docs/architecture.md, "Storage").

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Alembic autogenerate output, checked by hand: server defaults made portable (`now()`, `false()`),
JSON type named once, indexes created with plain `op.create_index`, downgrade drops tables only.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# storage.types.JsonType, BigIntKey; packed arrays (storage.types.*Array) are plain binary columns.
JSON = sa.JSON(none_as_null=True)  # `json` on Postgres: jsonb rejects \u0000, which model text may hold
BIGINT_KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _created_at() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("task", JSON, nullable=True),
        _created_at(),
        sa.CheckConstraint("size >= 1", name=op.f("ck_groups_size_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_groups")),
    )
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("checkpoint_path", sa.Text(), nullable=False),
        _created_at(),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.String(length=64), nullable=True),
        sa.Column("task", JSON, nullable=True),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("status", sa.String(length=16), server_default="active", nullable=False),
        _created_at(),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(status = 'active' AND ended_at IS NULL) OR (status <> 'active' AND ended_at IS NOT NULL)",
            name=op.f("ck_sessions_ended_at_matches_status"),
        ),
        sa.CheckConstraint(
            "status IN ('active', 'ended', 'finalized')", name=op.f("ck_sessions_status_known")
        ),
        sa.ForeignKeyConstraint(["group_id"], ["groups.id"], name=op.f("fk_sessions_group_id_groups")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_group_id"), "sessions", ["group_id"], unique=False)

    op.create_table(
        "train_steps",
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=False),
        sa.Column("metrics", JSON, nullable=False),
        _created_at(),
        sa.ForeignKeyConstraint(
            ["policy_version"],
            ["policy_versions.version"],
            name=op.f("fk_train_steps_policy_version_policy_versions"),
        ),
        sa.PrimaryKeyConstraint("step", name=op.f("pk_train_steps")),
    )
    op.create_index(op.f("ix_train_steps_policy_version"), "train_steps", ["policy_version"], unique=False)

    op.create_table(
        "api_keys",
        sa.Column("id", BIGINT_KEY, nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=True),
        _created_at(),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(scope = 'admin' AND session_id IS NULL) OR (scope = 'session' AND session_id IS NOT NULL)",
            name=op.f("ck_api_keys_scope_matches_session"),
        ),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_api_keys_session_id_sessions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_session_id"), "api_keys", ["session_id"], unique=False)

    op.create_table(
        "completions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("parent_id", sa.String(length=64), nullable=True),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_ids", sa.LargeBinary(), nullable=False),
        sa.Column("output_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("output_versions", sa.LargeBinary(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=False),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("top_p", sa.Double(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("branched", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("request_json", JSON, nullable=False),
        sa.Column("response_json", JSON, nullable=False),
        _created_at(),
        sa.CheckConstraint(
            "length(output_ids) = length(output_logprobs) AND length(output_ids) = length(output_versions)",
            name=op.f("ck_completions_output_lengths_match"),
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["completions.id"], name=op.f("fk_completions_parent_id_completions")
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_completions_session_id_sessions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_completions")),
    )
    op.create_index(op.f("ix_completions_parent_id"), "completions", ["parent_id"], unique=False)
    op.create_index(
        "ix_completions_session_id_created_at", "completions", ["session_id", "created_at"], unique=False
    )

    op.create_table(
        "trajectories",
        sa.Column("id", BIGINT_KEY, nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.String(length=64), nullable=True),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("loss_mask", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("versions", sa.LargeBinary(), nullable=False),
        sa.Column("reward", sa.Double(), nullable=False),
        sa.Column("min_version", sa.Integer(), nullable=False),
        _created_at(),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("claim_token", sa.String(length=36), nullable=True),
        sa.Column("consumed_step", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "(claim_token IS NULL AND claimed_at IS NULL) OR (claim_token IS NOT NULL AND claimed_at IS NOT NULL)",
            name=op.f("ck_trajectories_claim_complete"),
        ),
        sa.CheckConstraint(
            "length(token_ids) = length(logprobs) AND length(token_ids) = length(versions)"
            " AND length(token_ids) = 4 * length(loss_mask)",
            name=op.f("ck_trajectories_lengths_match"),
        ),
        sa.CheckConstraint("reward BETWEEN -1e308 AND 1e308", name=op.f("ck_trajectories_reward_finite")),
        sa.ForeignKeyConstraint(
            ["consumed_step"], ["train_steps.step"], name=op.f("fk_trajectories_consumed_step_train_steps")
        ),
        sa.ForeignKeyConstraint(["group_id"], ["groups.id"], name=op.f("fk_trajectories_group_id_groups")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_trajectories_session_id_sessions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trajectories")),
    )
    op.create_index(op.f("ix_trajectories_consumed_step"), "trajectories", ["consumed_step"], unique=False)
    op.create_index(op.f("ix_trajectories_group_id"), "trajectories", ["group_id"], unique=False)
    op.create_index(op.f("ix_trajectories_session_id"), "trajectories", ["session_id"], unique=False)
    op.create_index(op.f("ix_trajectories_claim_token"), "trajectories", ["claim_token"], unique=False)
    op.create_index(
        "ix_trajectories_unconsumed",
        "trajectories",
        ["min_version", "id"],
        unique=False,
        sqlite_where=sa.text("consumed_step IS NULL"),
        postgresql_where=sa.text("consumed_step IS NULL"),
    )

    op.create_table(
        "rewards",
        sa.Column("id", BIGINT_KEY, nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=True),
        sa.Column("completion_id", sa.String(length=64), nullable=True),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("source", sa.String(length=64), nullable=False),
        sa.Column("details", JSON, nullable=False),
        _created_at(),
        sa.CheckConstraint(
            "(session_id IS NULL AND completion_id IS NOT NULL)"
            " OR (session_id IS NOT NULL AND completion_id IS NULL)",
            name=op.f("ck_rewards_one_target"),
        ),
        sa.CheckConstraint("value BETWEEN -1e308 AND 1e308", name=op.f("ck_rewards_value_finite")),
        sa.ForeignKeyConstraint(
            ["completion_id"], ["completions.id"], name=op.f("fk_rewards_completion_id_completions")
        ),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name=op.f("fk_rewards_session_id_sessions")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rewards")),
    )
    op.create_index(op.f("ix_rewards_completion_id"), "rewards", ["completion_id"], unique=False)
    op.create_index(op.f("ix_rewards_session_id"), "rewards", ["session_id"], unique=False)


def downgrade() -> None:
    # Dropping a table drops its indexes; children before parents for the foreign keys.
    for table in (
        "rewards",
        "trajectories",
        "completions",
        "api_keys",
        "train_steps",
        "sessions",
        "policy_versions",
        "groups",
    ):
        op.drop_table(table)
