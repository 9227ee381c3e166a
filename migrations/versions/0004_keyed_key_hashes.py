"""Keyed key hashes and per-key limits: api_keys.hash_scheme says how a row's key_hash was computed
('sha256' before this revision, 'hmac-sha256' with the server secret after it; storage/keys.py), and
three nullable limits a rate limiter reads per key: requests_per_s, burst, tokens_per_day.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

Written by hand. Existing rows get hash_scheme 'sha256' from the server default, which also marks rows
a process predating this revision writes; each is rewritten to 'hmac-sha256' (with the sessions its
online key owns) the first time its key is used. The secret itself is not in the database
(`storage.key_secret`, or a file beside a SQLite database). SQLite cannot add a check constraint in
place, so api_keys is rebuilt in batch mode. The downgrade drops the columns: keys hashed with the
secret no longer authenticate after it, since the older code compares sha256 digests only.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("hash_scheme", sa.String(length=16), server_default="sha256", nullable=False)
        )
        batch.add_column(sa.Column("requests_per_s", sa.Double(), nullable=True))
        batch.add_column(sa.Column("burst", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_per_day", sa.BigInteger(), nullable=True))
        batch.create_check_constraint("hash_scheme_known", "hash_scheme IN ('sha256', 'hmac-sha256')")


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint(op.f("ck_api_keys_hash_scheme_known"), type_="check")
        batch.drop_column("tokens_per_day")
        batch.drop_column("burst")
        batch.drop_column("requests_per_s")
        batch.drop_column("hash_scheme")
