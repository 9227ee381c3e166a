"""What a recorded Responses API call contributes to its session's conversation tree
(proxy/conversations/tree.py), which otherwise learns only chat records.

A Responses call is recorded with its request as the client sent it (GET /v1/responses/{id} and
`previous_response_id` read it) plus a `chat_view`: the chat-template messages it added to its parent's
history, the tools it rendered, and the assistant message its output items make, exactly as a client
re-sending those items (or naming this response as `previous_response_id`) makes it again, so the next
turn chains onto this one whichever way it continues, and chat and Responses turns of one session chain
onto each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.conversations.tree import CHAT_VIEW, chat_view
from proxy.errors import OpenAIError
from proxy.openai.responses.input import items_to_messages


def answer_message(output: Any) -> dict[str, Any] | None:
    """The assistant message a response's output items make; None when they make none (no output) or
    more than one (text after calls), which nothing can then extend."""
    if not isinstance(output, list):
        return None
    try:
        answers = items_to_messages(None, output)
    except OpenAIError:
        return None
    return answers[0] if len(answers) == 1 else None


def request_with_view(
    request_json: dict[str, Any], messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> dict[str, Any]:
    """The request to record, before its answer is known: as sent, plus the chat view of its messages."""
    return {**request_json, CHAT_VIEW: chat_view(messages, tools, None)}


def request_answered(request_json: dict[str, Any], response_json: dict[str, Any]) -> dict[str, Any]:
    """The recorded request with its chat view's answer: the message `response_json`'s output makes."""
    view = {**request_json[CHAT_VIEW], "answer": answer_message(response_json.get("output"))}
    return {**request_json, CHAT_VIEW: view}
