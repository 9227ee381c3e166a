"""Online keys (`flywheel keys create --online`): a long-lived key without sessions of its own. Each call
on it is matched against the conversations of the active sessions its earlier calls made: a call that
extends one joins that session (and chains token-exactly, proxy/conversations.py); any other call starts
a new session, owned by the key (sessions.owner_key_hash, metadata origin "online"). The key may reward
and end the sessions it owns (proxy/rl_sessions.check_may_act); sessions nobody ends are ended and
finalized by the finalizer's `session_ttl_s`, counted from their last call.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from proxy.auth import SESSION_KEY_PREFIX, Principal, generate_api_key
from proxy.conversation_text import MessageKey, is_assistant, message_key, tools_key
from storage.queries import active_owned_sessions, create_session, hash_api_key
from storage.records import SessionRecord

if TYPE_CHECKING:
    from proxy.services import ProxyServices

logger = logging.getLogger(__name__)

ONLINE_ORIGIN = "online"


async def online_session(
    services: ProxyServices, principal: Principal, messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> str:
    """The session of an online key's call: the active session it owns whose conversation the call
    extends most deeply (the newest on a tie), else a new session owned by the key."""
    if principal.key_hash is None:
        raise ValueError("an online principal carries its key hash")
    keys = [message_key(m) for m in messages]
    # A completion is matched by its messages and its answer, and the call must add a message after it:
    # without an assistant message before its last, a call starts a conversation.
    if any(is_assistant(key) for key in keys[:-1]):
        extended = await _extended_session(services, principal.key_hash, tools_key(tools), keys)
        if extended is not None:
            return extended
    return await open_online_session(services, principal.key_hash)


async def open_online_session(services: ProxyServices, key_hash: str, session_id: str | None = None) -> str:
    """Create a session owned by the online key `key_hash` (the one its call starts); return its id."""
    session_id = session_id or uuid.uuid4().hex
    # A session needs a session key to exist; nobody ever learns this one (the online key acts on it).
    await create_session(services.session_factory, SessionRecord(
        id=session_id, key_hash=hash_api_key(generate_api_key(SESSION_KEY_PREFIX)),
        metadata={"origin": ONLINE_ORIGIN}, owner_key_hash=key_hash,
    ))
    logger.info("online key call: new session %s", session_id)
    return session_id


async def _extended_session(
    services: ProxyServices, key_hash: str, tools_id: str | None, keys: Sequence[MessageKey]
) -> str | None:
    """The active session owned by `key_hash` whose conversation `keys` extend most deeply (the newest on
    a tie). Of the trees in memory only those that answered one of the call's assistant messages can
    hold it, and one query keeps those of them that are the key's and still active. The owned sessions
    not in memory (after a restart or an eviction, or recorded by another proxy) are loaded and tried
    when those hold none."""
    conversations = services.conversations
    depths = await _depths(services, conversations.sessions_answering(keys), tools_id, keys)
    if depths:
        owned = await active_owned_sessions(services.session_factory, key_hash, among=depths)
        found = _deepest(owned, depths)
        if found is not None:
            return found
    owned = await active_owned_sessions(services.session_factory, key_hash)
    unheld = [session_id for session_id in owned if not conversations.holds(session_id)]
    return _deepest(owned, await _depths(services, unheld, tools_id, keys))


async def _depths(
    services: ProxyServices, session_ids: Iterable[str], tools_id: str | None, keys: Sequence[MessageKey]
) -> dict[str, int]:
    """The sessions of `session_ids` holding a completion that `keys` extend, with the deepest one's
    length in messages."""
    depths = {}
    for session_id in session_ids:
        tree, _loaded = await services.conversations.tree(session_id)
        node = tree.deepest_prefix(tools_id, keys)
        if node is not None:
            depths[session_id] = len(node.path)
    return depths


def _deepest(newest_first: Sequence[str], depths: dict[str, int]) -> str | None:
    best: str | None = None
    for session_id in newest_first:
        if session_id in depths and (best is None or depths[session_id] > depths[best]):
            best = session_id
    return best
