"""proxy/anthropic/translate.py and record.py: a Messages request as the chat request it generates like,
and what its record teaches the conversation tree, so a client sending the answer's blocks back chains
onto it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.anthropic.record import recorded_request, request_answered
from proxy.anthropic.schemas import MessagesRequest
from proxy.anthropic.translate import SYSTEM_ORIGIN, chat_request
from proxy.conversations.tree import chat_record
from proxy.errors import OpenAIError
from rewards.message_keys import message_key
from storage.records import CompletionRecord

TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"},
        "cache_control": {"type": "ephemeral"}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def translated(**fields: Any) -> tuple[dict[str, Any], list[int]]:
    body = {"model": "m", "max_tokens": 16, **fields}
    translation = chat_request(MessagesRequest.model_validate(body), body)
    return translation.chat.model_dump(exclude_none=True), translation.origins


def test_a_conversation_becomes_chat_messages_in_order() -> None:
    chat, origins = translated(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                         {"type": "text", "text": "Paris."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."}, USE, {**USE, "id": "toolu_2", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_2",
                 "content": [{"type": "text", "text": "none"}]},
                {"type": "text", "text": "And?"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21", "is_error": False}]},
        ],
    )
    assert [(m["role"], m.get("content")) for m in chat["messages"]] == [
        ("system", "Be brief.\nBe kind."), ("user", "Weather?\nParis."), ("assistant", "Checking."),
        ("tool", "none"), ("tool", "21"), ("user", "And?"),
    ]
    assistant = chat["messages"][2]
    assert assistant["reasoning_content"] == "Look it up."
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in assistant["tool_calls"]] == [("toolu_1", "get_weather", {"city": "Paris"}),
                                                  ("toolu_2", "get_weather", {})]
    assert [(m["tool_call_id"], m["name"]) for m in chat["messages"][3:5]] == [("toolu_2", "get_weather"),
                                                                             ("toolu_1", "get_weather")]
    assert origins == [SYSTEM_ORIGIN, 0, 1, 2, 2, 2]


def test_tools_tool_choice_and_sampling_become_chats() -> None:
    server = {"type": "web_search_20250305", "name": "web_search"}
    chat, _ = translated(
        messages=[{"role": "user", "content": "hi"}],
        tools=[TOOL, server, {**TOOL, "type": "custom", "name": "g"}],
        tool_choice={"type": "tool", "name": "g", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=0, metadata={"user_id": "u1"}, seed=7,
        thinking={"type": "enabled", "budget_tokens": 1024}, service_tier="auto",
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema_": {"type": "object"}}}
    assert [tool["function"] for tool in chat["tools"]] == [
        {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}},
        {"name": "g", "description": "Weather.", "parameters": {"type": "object"}},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "g"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["temperature"], chat["top_p"], chat["max_tokens"]) == (["END"], 0.5, 0.9, 16)
    assert "top_k" not in chat and chat["user"] == "u1" and chat["seed"] == 7

    for choice, expected in (("any", "required"), ("auto", "auto"), ("none", "none")):
        assert translated(messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                          tool_choice={"type": choice})[0]["tool_choice"] == expected
    only_server, _ = translated(messages=[{"role": "user", "content": "hi"}], tools=[server],
                                tool_choice={"type": "any"})
    assert "tools" not in only_server and "tool_choice" not in only_server  # nothing left to choose from


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": [{**USE, "input": "x"}]}]},
         "messages[0].content[0].input"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"messages": [{"role": "user", "content": "hi"}], "system": [{"type": "document"}]}, "system[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
         "tools[0].input_schema"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
          "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
        ({"messages": [{"role": "user", "content": "hi"}], "output_config": {"format": {"type": "text"}}},
         "output_config.format"),
    ],
    ids=["image", "empty", "input-not-object", "no-tool-use-id", "system-document", "no-schema",
         "unknown-tool", "output-format"],
)
def test_what_cannot_be_translated_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        translated(**fields)
    assert (raised.value.status, raised.value.param) == (400, param)


def _record(request_json: dict[str, Any], content: list[dict[str, Any]]) -> CompletionRecord:
    response_json = {"id": "msg_1", "type": "message", "content": content}
    return CompletionRecord(
        id="msg_1", session_id="s", parent_id=None, prompt_ids=[1], output_ids=[2], output_logprobs=[0.0],
        output_versions=[0], finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1,
        request_json=request_answered(request_json, response_json), response_json=response_json,
    )


def test_a_recorded_message_teaches_the_turn_a_client_sends_back() -> None:
    answer = [{"type": "thinking", "thinking": "hm", "signature": ""},
              {"type": "text", "text": "Checking."}, USE]
    first = [{"role": "user", "content": "Weather?"}]
    body = {"model": "m", "max_tokens": 16, "system": "Be brief.", "messages": first}
    translation = chat_request(MessagesRequest.model_validate(body), body)
    messages = translation.chat.template_messages()
    keys = chat_record(_record(recorded_request(body, translation.origins, 0, messages, None), answer))
    assert keys is not None

    resent = [*first, {"role": "assistant", "content": [{**USE, "id": "toolu_other"}, answer[1]]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other",
                                            "content": "21"}]}]
    later = {**body, "messages": resent}
    again = chat_request(MessagesRequest.model_validate(later), later)
    resent_messages = again.chat.template_messages()
    assert keys == ([message_key(m) for m in messages], None, message_key(resent_messages[2]))

    recorded = recorded_request(later, again.origins, 3, resent_messages, None)
    assert recorded["messages"] == resent[2:] and "system" not in recorded  # the parent holds the rest
    assert recorded["chat_view"]["messages"] == resent_messages[3:]
