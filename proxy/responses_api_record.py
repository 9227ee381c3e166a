"""What a recorded Responses API call contributes to its session's conversation tree
(proxy/conversations.py), which otherwise learns only chat records.

A Responses call is recorded with its request as the client sent it (GET /v1/responses/{id} and
`previous_response_id` read it) plus `chat_view`: the chat-template messages it added to its parent's
history and the tools it rendered. Its answer is the assistant message its output items make, exactly
as a client re-sending those items (or naming this response as `previous_response_id`) makes it again,
so the next turn chains onto this one whichever way it continues, and chat and Responses turns of one
session chain onto each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.conversation_text import MessageKey, message_key, tools_key
from proxy.errors import OpenAIError
from proxy.responses_api_input import items_to_messages
from storage.records import CompletionRecord

CHAT_VIEW = "chat_view"


def chat_view(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """The `chat_view` entry of a Responses call's request_json: its new messages and its tools."""
    return {"messages": list(messages), "tools": list(tools) if tools else None}


def responses_record_keys(record: CompletionRecord) -> tuple[list[MessageKey], str | None, MessageKey] | None:
    """(new message keys, tools key, answer key) of a recorded Responses call; None if it is none."""
    view = record.request_json.get(CHAT_VIEW)
    output = record.response_json.get("output")
    if not isinstance(view, dict) or not isinstance(output, list):
        return None
    try:
        answers = items_to_messages(None, output)
    except OpenAIError:
        return None
    if len(answers) != 1:  # text and calls merge into one message; no output, or text after calls, is none
        return None
    keys = [message_key(message) for message in view.get("messages") or ()]
    return keys, tools_key(view.get("tools")), message_key(answers[0])
