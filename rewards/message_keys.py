"""What makes two chat messages "the same" (docs/architecture.md, "The token-exact rule"): the keys the
proxy's prefix matching compares (proxy/conversations/), and the retry-orphan check compares a call's new
messages by (rewards/orphans.py).

Keys ignore what clients rewrite or drop: tool-call ids, `tool_call_id`, `name` and `reasoning_content`
(agents often drop it, and the parent's output tokens keep the reasoning anyway), and the whitespace
around an assistant message's text (agents such as hermes-agent strip the answers they send back; the
parent's output tokens keep it). Tool-call arguments compare as parsed JSON, so `{"a": 1}` and
`{ "a" : 1 }` are one call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ToolCallKey = tuple[str, str]
MessageKey = tuple[str, str, tuple[ToolCallKey, ...]]
"""(role, content text, ((function name, canonical arguments), ...))."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON text; a string that is not JSON stays as it is."""
    if isinstance(arguments, str):
        try:
            return canonical_json(json.loads(arguments))
        except ValueError:
            return arguments
    return canonical_json(arguments)


def content_text(content: Any) -> str:
    """Content as the template sees it: a string, text parts joined by newlines (as
    proxy.conversations.messages.ChatMessage.text joins them), None as the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                value = part.get("text") if part.get("type") == "text" else part.get("refusal")
                parts.append(str(value or ""))
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return str(content)


def message_key(message: Mapping[str, Any]) -> MessageKey:
    """What prefix matching compares of one message (a request's, or the assistant message the proxy
    answered): role, text (an assistant's without surrounding whitespace) and tool calls by name and
    parsed arguments, never ids."""
    calls: list[ToolCallKey] = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append((str(function.get("name", "")), canonical_arguments(function.get("arguments", ""))))
    role = str(message.get("role", ""))
    text = content_text(message.get("content"))
    return (role, text.strip() if role == "assistant" else text, tuple(calls))


def is_assistant(key: MessageKey) -> bool:
    """Whether a message key is an assistant turn (what a completion's answer always is)."""
    return key[0] == "assistant"


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The tools rendered into a prompt: a different tool list is a different history."""
    return canonical_json(list(tools)) if tools else None
