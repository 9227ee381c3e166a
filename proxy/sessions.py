"""Session and group ids, and the sessions the proxy opens by itself: one for each admin call (which
has no session of its own) and one for each new conversation on an online key. Such a session's key
is never handed out: an admin key, or the online key that owns the session, acts on it."""

from __future__ import annotations

import logging
import secrets
from typing import Any, Literal

from proxy.auth import SESSION_KEY_PREFIX, generate_api_key
from storage.engine import SessionFactory
from storage.queries import create_session, hash_api_key
from storage.records import SessionRecord

logger = logging.getLogger(__name__)

Origin = Literal["admin-call", "online"]
ADMIN_CALL_ORIGIN: Origin = "admin-call"
ONLINE_ORIGIN: Origin = "online"


def new_session_id() -> str:
    return f"sess_{secrets.token_hex(12)}"


def new_group_id() -> str:
    return f"grp_{secrets.token_hex(12)}"


async def create_hidden_session(
    session_factory: SessionFactory, origin: Origin, owner_key_hash: str | None = None,
    session_id: str | None = None,
) -> str:
    """Create a session (`session_id`, else a new id) for a call that has none (metadata `origin`);
    return its id. `owner_key_hash`: the online key that owns it (and may reward and end it). Nobody
    rewards a one-off admin call, so its session is never trained on (`missing_reward: drop`, which the
    finalizer honours)."""
    session_id = session_id or new_session_id()
    metadata: dict[str, Any] = {"origin": origin}
    if origin == ADMIN_CALL_ORIGIN:
        metadata["missing_reward"] = "drop"
    # A session needs a key to exist; nobody ever learns this one.
    await create_session(session_factory, SessionRecord(
        id=session_id, key_hash=hash_api_key(generate_api_key(SESSION_KEY_PREFIX)), metadata=metadata,
        owner_key_hash=owner_key_hash,
    ))
    logger.debug("session %s opened for a call (%s)", session_id, origin)
    return session_id
