"""The keys a chat call hands the conversation index with its records (so the index need not validate
the recorded request again) are exactly those the index parses back from the record."""

from __future__ import annotations

from typing import Any

from proxy.conversations.text import message_key, tools_key
from proxy.conversations.tree import SessionTree, chat_record
from proxy.openai.schemas import ChatCompletionRequest
from storage.records import CompletionRecord

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]


def test_keys_handed_over_equal_the_keys_parsed_from_the_record() -> None:
    request = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    body = ChatCompletionRequest.model_validate(request)
    keys = (tuple(message_key(m) for m in body.template_messages()), tools_key(body.template_tools()))
    record = CompletionRecord(
        id="chatcmpl-1", session_id="s", parent_id=None, prompt_ids=[1, 2], output_ids=[7],
        output_logprobs=[0.0], output_versions=[0], finish_reason="stop", temperature=1.0, top_p=1.0,
        top_k=-1, request_json=request,
        response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "It is 42."}}]},
    )
    assert chat_record(record, keys) == chat_record(record) is not None
    parsed, handed = SessionTree(), SessionTree()
    assert parsed.add(record) and handed.add(record, keys)
    assert parsed.nodes["chatcmpl-1"].path == handed.nodes["chatcmpl-1"].path
    assert parsed.nodes["chatcmpl-1"].path_hash == handed.nodes["chatcmpl-1"].path_hash
