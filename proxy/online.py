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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from proxy.auth import SESSION_KEY_PREFIX, Principal, generate_api_key
from proxy.conversation_text import message_key, tools_key
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
    tools_id = tools_key(tools)
    best: tuple[int, str] | None = None
    for session_id in await active_owned_sessions(services.session_factory, principal.key_hash):
        tree, _loaded = await services.conversations.tree(session_id)
        node = tree.deepest_prefix(tools_id, keys)
        if node is not None and (best is None or len(node.path) > best[0]):
            best = (len(node.path), session_id)
    if best is not None:
        return best[1]
    session_id = uuid.uuid4().hex
    # A session needs a session key to exist; nobody ever learns this one (the online key acts on it).
    await create_session(services.session_factory, SessionRecord(
        id=session_id, key_hash=hash_api_key(generate_api_key(SESSION_KEY_PREFIX)),
        metadata={"origin": ONLINE_ORIGIN}, owner_key_hash=principal.key_hash,
    ))
    logger.info("online key call: new session %s", session_id)
    return session_id
