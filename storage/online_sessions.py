"""The sessions an online key's calls make, as its conversation hints and new conversations find them
(proxy/conversations/online.py): the session a hint names, and the sessions a new conversation ends.
The sessions its unhinted calls may join by their messages are `storage.queries.active_owned_sessions`."""

from __future__ import annotations

from sqlalchemy import select

from storage.engine import SessionFactory
from storage.models import Session, SessionStatus


async def hinted_session(
    session_factory: SessionFactory, owner_key_hash: str, conversation: str
) -> str | None:
    """The active session an online key owns with this conversation hint (the newest, should there be
    several), or None."""
    query = (
        select(Session.id)
        .where(
            Session.owner_key_hash == owner_key_hash,
            Session.conversation == conversation,
            Session.status == SessionStatus.ACTIVE.value,
        )
        .order_by(Session.created_at.desc(), Session.id)
        .limit(1)
    )
    async with session_factory() as db:
        return await db.scalar(query)


async def older_unhinted_sessions(
    session_factory: SessionFactory, owner_key_hash: str, newer: str
) -> list[str]:
    """The active sessions without a conversation hint that an online key owns and that were created
    before its session `newer` (so that two conversations starting at once do not end each other), oldest
    first."""
    created = select(Session.created_at).where(Session.id == newer).scalar_subquery()
    query = (
        select(Session.id)
        .where(
            Session.owner_key_hash == owner_key_hash,
            Session.conversation.is_(None),
            Session.status == SessionStatus.ACTIVE.value,
            Session.id != newer,
            Session.created_at < created,
        )
        .order_by(Session.created_at, Session.id)
    )
    async with session_factory() as db:
        return list((await db.execute(query)).scalars())
