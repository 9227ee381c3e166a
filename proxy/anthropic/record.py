"""What a recorded Messages API call holds and contributes to its session's conversation tree
(proxy/conversations/tree.py), which otherwise learns only chat records.

A call is recorded with its request as sent, less the history its parent already holds (a chained call
keeps the messages from the one its new chat messages came from, and no system prompt), plus a
`chat_view`: the chat-template messages it added to its parent's history, the tools it rendered, and
the assistant message its content blocks make, exactly as a client sending those blocks back makes it
again (proxy/anthropic/translate.py), so the next turn chains onto this one, and chat, Responses and
Messages turns of one session chain onto each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.anthropic.translate import assistant_message
from proxy.conversations.messages import ChatMessage
from proxy.conversations.tree import CHAT_VIEW, chat_view


def recorded_request(
    request_json: dict[str, Any], origins: Sequence[int], new_from: int, messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The request to record, before its answer is known. `origins` are the request message each chat
    message came from; `new_from` the first chat message the parent does not hold."""
    recorded = dict(request_json)
    if new_from:
        recorded["messages"] = request_json["messages"][origins[new_from]:]
        recorded.pop("system", None)
    recorded[CHAT_VIEW] = chat_view(messages[new_from:], tools, None)
    return recorded


def answer_message(content: Any) -> dict[str, Any]:
    """The chat-template message of a message's content blocks."""
    return ChatMessage.model_validate(assistant_message(content, "content")).to_template()


def request_answered(request_json: dict[str, Any], message_json: dict[str, Any]) -> dict[str, Any]:
    """The recorded request with its chat view's answer: the message `message_json`'s content makes."""
    view = {**request_json[CHAT_VIEW], "answer": answer_message(message_json["content"])}
    return {**request_json, CHAT_VIEW: view}
