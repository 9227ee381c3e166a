"""proxy/openai/responses/input.py: Responses API input items and tools as chat messages and chat tools,
and a Responses request as the chat request the pipeline runs."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import OpenAIError
from proxy.openai.responses.input import (
    ResponsesRequest,
    chat_request,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
)

CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}',
        "status": "completed"}
CALL_2 = {**CALL, "id": "fc_2", "call_id": "call_2", "arguments": '{"x": 2}'}


def test_text_calls_and_outputs_become_one_assistant_message_then_tool_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        CALL, CALL_2,
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert items_to_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "r", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
    ]


def test_calls_without_text_make_an_assistant_message_and_a_dangling_reasoning_is_dropped() -> None:
    items = [{"role": "user", "content": "q"}, CALL, {"type": "reasoning", "summary": [
        {"type": "summary_text", "text": "lost"}]}]
    messages = items_to_messages(None, items)
    assert messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    ]


@pytest.mark.parametrize(("item", "code"), [
    ({"type": "item_reference", "id": "x"}, "unsupported_item_type"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}, "unsupported_content_type"),
    ({"role": "tool", "content": "x"}, None),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, None),  # no call_id
    ({"type": "function_call_output", "call_id": "c"}, None),  # no output
    ("just a string", None),
])
def test_unsupported_or_malformed_items_are_400s_naming_the_item(item: Any, code: str | None) -> None:
    with pytest.raises(OpenAIError) as error:
        items_to_messages(None, [{"role": "user", "content": "q"}, item])
    assert error.value.status == 400 and error.value.param == "input[1]" and error.value.code == code


def test_function_tools_and_tool_choice_in_chat_form() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
            "strict": True}
    assert chat_tools([tool]) == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}]
    with pytest.raises(OpenAIError) as error:
        chat_tools([tool, {"type": "apply_patch"}])
    assert error.value.param == "tools[1]" and "apply_patch" in error.value.message
    named = {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice({"type": "function", "name": "f"}) == named
    assert chat_tool_choice("required") == "required"
    assert chat_tool_choice({"type": "allowed_tools", "mode": "auto", "tools": []}) == "auto"
    with pytest.raises(OpenAIError):
        chat_tool_choice({"type": "web_search_preview"})


def test_chat_request_carries_sampling_and_extensions() -> None:
    raw = {"model": "m", "input": "hi", "max_output_tokens": 7, "temperature": 0.5, "top_k": 3,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2, "parallel_tool_calls": False}
    chat = chat_request(ResponsesRequest.model_validate(raw), [], raw)
    assert chat.template_messages() == [{"role": "user", "content": "hi"}]
    assert chat.requested_max_tokens() == 7 and chat.temperature == 0.5 and chat.top_k == 3
    assert chat.wants_logprobs and chat.top_logprobs == 2 and chat.parallel_tool_calls is False
