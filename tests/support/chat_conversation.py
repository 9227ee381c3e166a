"""A small tool-calling conversation as chat messages, for the unit tests of proxy/conversations/: a
user asks, the assistant calls `f`, the tool answers 42, the assistant answers, the user asks for more."""

from __future__ import annotations

from typing import Any


def call(name: str, arguments: Any, call_id: str = "call_1") -> dict[str, Any]:
    """An OpenAI tool call (`arguments` as the JSON text a client sends, or already parsed)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"x": 1}')]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
FINAL = {"role": "assistant", "content": "It is 42."}
SUMMARY = {"role": "user", "content": "Summarize."}
