"""The sessions an online key's calls make, as its conversation hints and new conversations find them
(proxy/conversations/online.py): the session a hint names, and the sessions a new conversation ends.
The sessions its unhinted calls may join by their messages are `storage.queries.active_owned_sessions`.

A hint names one active session of its key, whichever proxy opens it: the creating transaction takes
turns with the other creations of that (key, hint) (a transaction-scoped advisory lock on Postgres;
SQLite's BEGIN IMMEDIATE serialises every writer) and refuses, with `ConversationTaken`, when an active
session with that hint exists, so two proxies opening one conversation at once make one session."""

from __future__ import annotations

import hashlib

from sqlalchemy import Select, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from storage.engine import SessionFactory
from storage.models import Session, SessionStatus


class ConversationTaken(Exception):
    """Another call (maybe on another proxy) opened the session of this conversation hint first."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"the conversation's session {session_id} was opened meanwhile")
        self.session_id = session_id


def hint_lock_key(owner_key_hash: str, conversation: str) -> int:
    """The advisory lock of one (online key, hint) pair: a signed 64-bit number drawn from both (a
    collision only makes two creations take turns)."""
    digest = hashlib.sha256(f"{owner_key_hash}\n{conversation}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


async def claim_hint(db: AsyncSession, owner_key_hash: str, conversation: str) -> None:
    """In the transaction creating a hinted session: wait for the other creations of the same hint, then
    raise ConversationTaken if the key has an active session with it already."""
    if db.get_bind().dialect.name == "postgresql":
        await db.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                         {"key": hint_lock_key(owner_key_hash, conversation)})
    existing = await db.scalar(_hinted(owner_key_hash, conversation))
    if existing is not None:
        raise ConversationTaken(existing)


async def hinted_session(
    session_factory: SessionFactory, owner_key_hash: str, conversation: str
) -> str | None:
    """The active session an online key owns with this conversation hint (the newest, should there be
    several), or None."""
    async with session_factory() as db:
        return await db.scalar(_hinted(owner_key_hash, conversation))


def _hinted(owner_key_hash: str, conversation: str) -> Select[str]:
    return (
        select(Session.id)
        .where(
            Session.owner_key_hash == owner_key_hash,
            Session.conversation == conversation,
            Session.status == SessionStatus.ACTIVE.value,
        )
        .order_by(Session.created_at.desc(), Session.id)
        .limit(1)
    )


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
