"""Pure pieces of token-exact multi-turn conversations (docs/architecture.md, "The token-exact rule"): what
makes two messages "the same" for prefix matching, and the tokens the chat template adds after a parent
completion's output.

Matching keys ignore what clients rewrite or drop: tool-call ids, `tool_call_id`, `name` and
`reasoning_content` (agents often drop it, and the parent's output tokens keep the reasoning anyway).
Tool-call arguments compare as parsed JSON, so `{"a": 1}` and `{ "a" : 1 }` are one call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

ToolCallKey = tuple[str, str]
MessageKey = tuple[str, str, tuple[ToolCallKey, ...]]
"""(role, content text, ((function name, canonical arguments), ...))."""
ConversationKeys = tuple[tuple[MessageKey, ...], str | None]
"""The keys of the messages a call's record stores and its tools key, as the call computed them: the
conversation index takes them instead of validating the recorded request again."""

# Stand-ins that no real conversation contains: the suffix is read off a render that follows them.
_DUMMY_USER = "\u2063flywheel-dummy-user\u2063"
_DUMMY_ASSISTANT = "\u2063flywheel-dummy-assistant\u2063"


class SuffixError(ValueError):
    """The chat template does not render the new messages as a plain continuation of a history."""


class TemplateRenderer(Protocol):
    """What suffix rendering needs of proxy.tokenize.ChatTokenizer."""

    def render_text(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as canonical JSON text; a string that is not JSON stays as it is."""
    if isinstance(arguments, str):
        try:
            return _canonical_json(json.loads(arguments))
        except ValueError:
            return arguments
    return _canonical_json(arguments)


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
    answered): role, text and tool calls by name and parsed arguments, never ids."""
    calls: list[ToolCallKey] = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        calls.append((str(function.get("name", "")), canonical_arguments(function.get("arguments", ""))))
    return (str(message.get("role", "")), content_text(message.get("content")), tuple(calls))


def is_assistant(key: MessageKey) -> bool:
    """Whether a message key is an assistant turn (what a completion's answer always is)."""
    return key[0] == "assistant"


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """The tools rendered into a prompt: a different tool list is a different history."""
    return _canonical_json(list(tools)) if tools else None


def prefix_hashes(tools: str | None, keys: Sequence[MessageKey]) -> list[int]:
    """Rolling hashes: element k-1 stands for the first k messages (with the tools)."""
    hashes: list[int] = []
    running = hash(("tools", tools))
    for key in keys:
        running = hash((running, key))
        hashes.append(running)
    return hashes


def closed_length(output_ids: Sequence[int], close_ids: Sequence[int]) -> int:
    """How many leading tokens of the template's end-of-turn `close_ids` the output already ends with
    (an output that stopped on the end-of-turn token holds it; one cut off by length holds none)."""
    for count in range(min(len(close_ids), len(output_ids)), 0, -1):
        if list(output_ids[len(output_ids) - count:]) == list(close_ids[:count]):
            return count
    return 0


def render_suffix(
    renderer: TemplateRenderer, parent_output_ids: Sequence[int], new_messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """The tokens that follow a parent's prompt + output: the rest of its assistant turn's end, the new
    messages, and the generation prompt. The new messages are rendered after a fixed dummy exchange, not
    after the real history, so a template that rewrites earlier turns (Qwen3 drops old `<think>` blocks)
    cannot change tokens the model already saw."""
    dummy = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    closed = renderer.render_text(dummy, tools, add_generation_prompt=False)
    extended = renderer.render_text([*dummy, *new_messages], tools, add_generation_prompt=True)
    if _DUMMY_ASSISTANT not in closed or _DUMMY_ASSISTANT not in extended:
        raise SuffixError("the chat template does not render assistant content verbatim")
    close = closed[closed.rindex(_DUMMY_ASSISTANT) + len(_DUMMY_ASSISTANT):]
    after = extended[extended.rindex(_DUMMY_ASSISTANT) + len(_DUMMY_ASSISTANT):]
    if not after.startswith(close):
        raise SuffixError(f"the assistant turn ends as {close!r} alone but as {after[:len(close)]!r} here")
    close_ids = renderer.encode(close)
    done = closed_length(parent_output_ids, close_ids)
    return [*close_ids[done:], *renderer.encode(after[len(close):])]
