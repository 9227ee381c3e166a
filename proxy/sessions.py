"""Session and group ids; the sessions the proxy opens by itself: one for each admin call (which has no
session of its own) and one for each new conversation on an online key (such a session's key is never
handed out: an admin key, or the online key that owns the session, acts on it); the calls each session
has in flight, which its end waits for; and the hinted sessions being opened, which the other calls
with their hint wait for."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

from proxy.errors import OpenAIError
from storage.engine import SessionFactory
from storage.queries import create_session
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
    session_id: str | None = None, reward_hooks: list[dict[str, Any]] | None = None,
    conversation: str | None = None,
) -> str:
    """Create a session (`session_id`, else a new id) for a call that has none (metadata `origin`);
    return its id. `owner_key_hash`: the online key that owns it (and may reward and end it). Nobody
    rewards a one-off admin call, so its session is never trained on (`missing_reward: drop`, which the
    finalizer honours), nor are its hooks run; an online conversation's session is labelled by
    `reward_hooks`, and by `conversation` when its calls carry a hint (proxy/conversations/online.py):
    ConversationTaken when the key has an active session with that hint already (opened by another
    proxy meanwhile)."""
    session_id = session_id or new_session_id()
    metadata: dict[str, Any] = {"origin": origin}
    if origin == ADMIN_CALL_ORIGIN:
        metadata["missing_reward"] = "drop"
    # A session needs a key row to exist; this one stores a random digest that no key hashes to, so
    # nobody can ever present it.
    await create_session(session_factory, SessionRecord(
        id=session_id, key_hash=secrets.token_hex(32), metadata=metadata,
        owner_key_hash=owner_key_hash, reward_hooks=None if origin == ADMIN_CALL_ORIGIN else reward_hooks,
        conversation=conversation,
    ))
    logger.debug("session %s opened for a call (%s)", session_id, origin)
    return session_id


CLOSED_REMEMBERED_S = 600.0
"""How long a closed session stays refused here: longer than any call takes from its key check to its
start, after which the key check itself refuses the ended session."""
CLOSED_MAX = 100_000


class SessionCalls:
    """The calls each session has generating or recording in this proxy, so that ending a session loses
    none of them. Its finalization first `close`s the session (a call that had passed the key check but
    not yet started is refused with 409: the openai client retries it, and the retry finds the session
    ended), then waits until the calls that started before are recorded (`drained`), so every answered
    call is in the session's trajectories. Per proxy: a finalization on another proxy of the database
    does not wait for the calls here; the database refuses their completions once the session is
    finalized (migration 0006), and they are answered 409 `session_finalized`, never without being
    trained on."""

    def __init__(self) -> None:
        self._running: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._closed: OrderedDict[str, float] = OrderedDict()

    def enter(self, session_id: str) -> None:
        """A call of the session starts; 409 if the session is being ended (or was)."""
        if self._is_closed(session_id):
            raise OpenAIError(
                409, f"Session {session_id} ended while this call was starting; it was not run.",
                "conflict_error", code="session_ended",
            )
        self._running[session_id] = self._running.get(session_id, 0) + 1

    def leave(self, session_id: str) -> None:
        """A call of the session is done (recorded, or failed)."""
        left = self._running[session_id] - 1
        if left:
            self._running[session_id] = left
            return
        del self._running[session_id]
        idle = self._idle.pop(session_id, None)
        if idle is not None:
            idle.set()

    def close(self, session_id: str) -> None:
        """No call of the session may start from now on."""
        self._closed[session_id] = time.monotonic() + CLOSED_REMEMBERED_S
        self._closed.move_to_end(session_id)
        while len(self._closed) > CLOSED_MAX:
            self._closed.popitem(last=False)

    def busy(self, session_id: str) -> bool:
        """Whether a call of the session is running here."""
        return session_id in self._running

    async def drained(self, session_id: str) -> None:
        """Return once no call of the session is running here."""
        if session_id not in self._running:
            return
        idle = self._idle.setdefault(session_id, asyncio.Event())
        await idle.wait()

    def _is_closed(self, session_id: str) -> bool:
        until = self._closed.get(session_id)
        if until is None:
            return False
        if until < time.monotonic():
            del self._closed[session_id]
            return False
        return True


class NewConversations:
    """The hinted sessions this proxy is opening, by (online key, hint). The first call of a conversation
    hint reserves its session until the session is created (or the call failed first); the calls with
    that hint arriving meanwhile wait, then join it, so that calls opening one conversation at once share
    one session. Proxies do not see each other's reservations: when two open one conversation at once,
    the database refuses the second session (`storage.online_sessions.ConversationTaken`, raised by
    `create_hidden_session`), and that call is planned again in the first one's session."""

    def __init__(self) -> None:
        self._opening: dict[tuple[str, str], asyncio.Event] = {}

    async def settled(self, key_hash: str, hint: str) -> None:
        """Return once no call here is opening the session of this hint."""
        while (opening := self._opening.get((key_hash, hint))) is not None:
            await opening.wait()

    def reserve(self, key_hash: str, hint: str) -> Callable[[], None] | None:
        """Reserve opening the session of this hint; returns the release (call it once the session is
        created, or will never be), or None when another call holds the reservation."""
        key = (key_hash, hint)
        if key in self._opening:
            return None
        opening = self._opening[key] = asyncio.Event()

        def release() -> None:
            if self._opening.get(key) is opening:
                del self._opening[key]
                opening.set()

        return release
