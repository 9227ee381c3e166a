"""Daily token usage per API key (the `key_usage` table): added up by every proxy, read back for quotas."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import date

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite

from storage.engine import SessionFactory, write_transaction
from storage.models import KeyUsage


async def add_key_usage(session_factory: SessionFactory, day: date, tokens: Mapping[int, int]) -> None:
    """Add `tokens[key_id]` to each key's usage on `day`, in one transaction (an upsert per key, so
    proxies adding at once never lose each other's counts)."""
    if not tokens:
        return
    async with write_transaction(session_factory) as db:
        dialect = db.get_bind().dialect.name
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        rows = [{"key_id": key, "day": day, "tokens": count} for key, count in sorted(tokens.items())]
        statement = insert(KeyUsage).values(rows)
        await db.execute(statement.on_conflict_do_update(
            index_elements=[KeyUsage.key_id, KeyUsage.day],
            set_={"tokens": KeyUsage.tokens + statement.excluded.tokens},
        ))


async def key_usage_on(
    session_factory: SessionFactory, day: date, key_ids: Collection[int]
) -> dict[int, int]:
    """The tokens each of `key_ids` used on `day` (keys with none are left out)."""
    if not key_ids:
        return {}
    query = select(KeyUsage.key_id, KeyUsage.tokens).where(
        KeyUsage.day == day, KeyUsage.key_id.in_(list(key_ids))
    )
    async with session_factory() as db:
        return {row.key_id: int(row.tokens) for row in await db.execute(query)}
