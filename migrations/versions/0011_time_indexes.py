"""Indexes on the time columns the dashboard reads (docs/dashboard.md): its throughput windows count
completions, settled reward hook jobs and trajectories since a moment, and its sessions table pages
sessions newest first. Without them each poll of an open dashboard scans whole tables, which grow for as
long as a run lasts.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_completions_created_at", "completions", ["created_at"]),
    ("ix_reward_jobs_finished_at", "reward_jobs", ["finished_at"]),
    ("ix_trajectories_created_at", "trajectories", ["created_at"]),
    ("ix_sessions_created_at_id", "sessions", ["created_at", "id"]),
)


def upgrade() -> None:
    for name, table, columns in INDEXES:
        op.create_index(name, table, columns, unique=False)


def downgrade() -> None:
    for name, table, _columns in reversed(INDEXES):
        op.drop_index(name, table_name=table)
