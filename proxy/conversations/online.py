"""Online keys (`flywheel keys create --online`): a long-lived key without sessions of its own. Each chat
call on it is matched against the conversations of the active sessions its earlier calls made: a call
that extends one joins that session (and chains token-exactly, proxy/conversations/prompt.py); any other
call starts a new session, owned by the key (sessions.owner_key_hash, metadata origin "online"). The key
may reward and end the sessions it owns; sessions nobody ends are ended and finalized by the
finalizer's `session_ttl_s`, counted from their last call.

A call may name its conversation instead (`conversation_hint`: the `X-Flywheel-Conversation` header, for
agents that rewrite their history and so never extend their own earlier calls): it joins the active
session the key owns with that hint (sessions.conversation), or starts one with it, whatever its
messages; within that session its prompt still chains token-exactly where the history allows, else it is
a flagged branch. Hinted and unhinted calls never share a session: `find_online_session` looks only at
the key's sessions without a hint. docs/online.md says why a header, and what a new
conversation does to the last (`proxy.online.end_on_new_conversation`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.conversations.index import ConversationIndex
from proxy.errors import OpenAIError
from rewards.message_keys import MessageKey, is_assistant, message_key, tools_key
from storage.engine import SessionFactory
from storage.queries import active_owned_sessions

CONVERSATION_HEADER = "x-flywheel-conversation"
HINT_MAX_CHARS = 128  # sessions.conversation's width


def conversation_hint(value: str | None) -> str | None:
    """An online key's conversation hint, from its call's `X-Flywheel-Conversation` header (None without
    one): 1 to 128 printable ASCII characters, else a 400 naming the header."""
    if value is None:
        return None
    if 0 < len(value) <= HINT_MAX_CHARS and value.isascii() and value.isprintable():
        return value
    raise OpenAIError(
        400, f"The X-Flywheel-Conversation header must be 1 to {HINT_MAX_CHARS} printable ASCII characters.",
        "invalid_request_error", param="X-Flywheel-Conversation", code="invalid_conversation_hint",
    )


async def find_online_session(
    index: ConversationIndex, session_factory: SessionFactory, key_hash: str,
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
) -> str | None:
    """The session of an online key's unhinted call: the active session without a hint it owns whose
    conversation the call extends most deeply (the newest on a tie); None when the call starts a
    conversation (the caller then creates a session owned by the key: proxy/sessions.py)."""
    keys = [message_key(m) for m in messages]
    # A completion is matched by its messages and its answer, and the call must add a message after it:
    # without an assistant message before its last, a call starts a conversation.
    if not any(is_assistant(key) for key in keys[:-1]):
        return None
    return await _extended_session(index, session_factory, key_hash, tools_key(tools), keys)


@dataclass(frozen=True, slots=True)
class Reach:
    """How far a call's messages extend one session's conversation: the length of its deepest match,
    and whether that match explains every assistant message the call holds (`whole`): one the
    session never answered there means the call may belong to another session that holds it."""

    depth: int
    whole: bool


async def _extended_session(
    index: ConversationIndex, session_factory: SessionFactory, key_hash: str, tools_id: str | None,
    keys: Sequence[MessageKey],
) -> str | None:
    """The active session owned by `key_hash` whose conversation `keys` extend most deeply (the newest on
    a tie). Of the trees in memory only those that answered one of the call's assistant messages can
    hold it; one query keeps those of them that are the key's and still active, and the deepest wins if
    it explains the whole call. Otherwise (after a restart or an eviction, or with conversations another
    proxy served, whose trees here are missing, empty or behind) the owned sessions without completions
    in memory are loaded and tried too. Trees held here are reloaded where they may be behind
    (`ConversationIndex.match`), so every proxy of a database finds the same session."""
    reaches: dict[str, Reach] = {}
    answering = index.sessions_answering(keys)
    if answering:
        owned = await active_owned_sessions(session_factory, key_hash, among=answering)
        reaches = await _reaches(index, owned, tools_id, keys)
        found = _deepest(owned, reaches)
        if found is not None and reaches[found].whole:
            return found
    owned = await active_owned_sessions(session_factory, key_hash)
    unheld = [s for s in owned if s not in reaches and not index.holds_completions(s)]
    reaches.update(await _reaches(index, unheld, tools_id, keys))
    return _deepest(owned, reaches)


async def _reaches(
    index: ConversationIndex, session_ids: Iterable[str], tools_id: str | None, keys: Sequence[MessageKey]
) -> dict[str, Reach]:
    """The sessions of `session_ids` holding a completion that `keys` extend, with how far they do."""
    reaches = {}
    for session_id in session_ids:
        tree, match = await index.match(session_id, tools_id, keys, note_foreign=False)
        if match is not None:
            reaches[session_id] = Reach(match.length, not tree.may_be_stale_for(keys, tools_id, match.length))
    return reaches


def _deepest(newest_first: Sequence[str], reaches: dict[str, Reach]) -> str | None:
    best: str | None = None
    for session_id in newest_first:
        if session_id in reaches and (best is None or reaches[session_id].depth > reaches[best].depth):
            best = session_id
    return best
