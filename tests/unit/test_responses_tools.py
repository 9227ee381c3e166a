"""proxy/openai/responses/tools.py and the items it shapes: the Responses API's tool kinds (namespaces,
custom and local shell tools, hosted tools) as chat functions, calls to them as the output items each
kind answers with, those items replayed as the same chat tool call, and `text.format` as chat's
`response_format`. The requests are shaped like those Codex CLI 0.169.0 sends."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import OpenAIError
from proxy.openai.responses.input import (
    ResponsesRequest,
    chat_request,
    chat_response_format,
    items_to_messages,
)
from proxy.openai.responses.output import call_item
from proxy.openai.responses.tools import chat_tool_choice, chat_tools, flat_name, tool_refs
from proxy.parsers import ParsedToolCall
from rewards.message_keys import message_key

PARAMETERS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
EXEC = {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
        "parameters": PARAMETERS}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawns an agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}
GRAMMAR = 'start: "*** Begin Patch" LF body "*** End Patch"'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edits files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
NOTE = {"type": "custom", "name": "note", "format": {"type": "text"}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
             "tools": [SPAWN, NOTE]}
WEB_SEARCH = {"type": "web_search", "external_web_access": True}
CODEX_TOOLS = [EXEC, NAMESPACE, PATCH, WEB_SEARCH, {"type": "local_shell"}]


def test_every_kind_becomes_a_chat_function_and_hosted_tools_are_left_out() -> None:
    functions = {tool["function"]["name"]: tool["function"] for tool in chat_tools(CODEX_TOOLS) or []}
    assert list(functions) == ["exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__note",
                               "apply_patch", "local_shell"]
    assert functions["exec_command"] == {"name": "exec_command", "description": "Runs a command.",
                                         "parameters": PARAMETERS, "strict": False}
    assert functions["multi_agent_v1__spawn_agent"]["parameters"] == SPAWN["parameters"]
    patch = functions["apply_patch"]
    assert patch["description"] == "Edits files."
    assert patch["parameters"]["required"] == ["input"]
    assert GRAMMAR in patch["parameters"]["properties"]["input"]["description"]
    note = functions["multi_agent_v1__note"]["parameters"]["properties"]["input"]
    assert "free text" in note["description"]
    assert functions["local_shell"]["parameters"]["required"] == ["command"]
    refs = tool_refs(CODEX_TOOLS)
    assert (refs["multi_agent_v1__note"].kind, refs["multi_agent_v1__note"].name) == ("custom", "note")
    assert refs["multi_agent_v1__spawn_agent"].namespace == "multi_agent_v1"
    assert chat_tools([WEB_SEARCH, {"type": "image_generation"}]) == [] and chat_tools(None) is None


def test_flat_names_join_as_codex_joins_them() -> None:
    assert flat_name("send_message", "collaboration") == "collaboration__send_message"
    assert flat_name("__create_event", "mcp__calendar__") == "mcp__calendar__create_event"
    assert flat_name("exec_command", None) == "exec_command"


@pytest.mark.parametrize(("tools", "param", "code"), [
    ([EXEC, {"type": "shell"}], "tools[1]", "unsupported_tool_type"),
    ([{"type": "apply_patch"}], "tools[0]", "unsupported_tool_type"),
    ([{"type": "namespace", "name": "n", "tools": [EXEC, {"type": "local_shell"}]}], "tools[0].tools[1]",
     "unsupported_tool_type"),
    ([{"type": "namespace", "name": "n"}], "tools[0]", None),
    ([{"type": "function", "parameters": {}}], "tools[0]", None),
    ([{**PATCH, "format": {"type": "grammar", "syntax": "lark"}}], "tools[0].format", None),
    (["not a tool"], "tools[0]", "unsupported_tool_type"),
    ([{"type": ["web_search"]}], "tools[0]", "unsupported_tool_type"),
], ids=["shell", "apply-patch-tool", "namespaced-local-shell", "namespace-without-tools", "nameless",
        "grammar-without-definition", "string", "type-not-text"])
def test_tools_this_server_cannot_offer_are_400s_naming_them(
    tools: list[Any], param: str, code: str | None
) -> None:
    with pytest.raises(OpenAIError) as error:
        chat_tools(tools)
    assert error.value.status == 400 and error.value.param == param and error.value.code == code


def test_tool_choice_names_the_template_function() -> None:
    assert chat_tool_choice({"type": "custom", "name": "apply_patch"}) == {
        "type": "function", "function": {"name": "apply_patch"}}
    assert chat_tool_choice({"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}) == {
        "type": "function", "function": {"name": "multi_agent_v1__spawn_agent"}}
    assert chat_tool_choice({"type": "allowed_tools", "mode": "required", "tools": [EXEC]}) == "required"
    for hosted in ({"type": "web_search_preview"}, {"type": "image_generation"}):
        with pytest.raises(OpenAIError) as error:
            chat_tool_choice(hosted)
        assert error.value.param == "tool_choice" and "hosted tool" in error.value.message
    for unsupported in ({"type": "mcp", "server_label": "s"}, {"type": ["web_search"]}):
        with pytest.raises(OpenAIError):
            chat_tool_choice(unsupported)


CALLS = [
    ParsedToolCall("exec_command", '{"cmd": "ls"}'),
    ParsedToolCall("multi_agent_v1__spawn_agent", '{"message": "add a test"}'),
    ParsedToolCall("multi_agent_v1__note", '{"input": "remember this"}'),
    ParsedToolCall("apply_patch", '{"input": "*** Begin Patch\\n*** End Patch"}'),
    ParsedToolCall("local_shell", '{"command": ["cat", "a.txt"], "timeout_ms": 1000}'),
    ParsedToolCall("no_such_tool", '{"a": 1}'),
]


def test_calls_are_answered_as_the_items_their_tools_kind_has() -> None:
    refs = tool_refs(CODEX_TOOLS)
    plain, spawn, note, patch, shell, unknown = (call_item(call, refs) for call in CALLS)
    assert plain["type"] == "function_call" and plain["name"] == "exec_command" and "namespace" not in plain
    assert (spawn["type"], spawn["name"], spawn["namespace"]) == (
        "function_call", "spawn_agent", "multi_agent_v1")
    assert spawn["arguments"] == '{"message": "add a test"}' and spawn["id"].startswith("fc_")
    assert (note["type"], note["name"], note["namespace"], note["input"]) == (
        "custom_tool_call", "note", "multi_agent_v1", "remember this")
    assert patch["type"] == "custom_tool_call" and patch["input"] == "*** Begin Patch\n*** End Patch"
    assert patch["call_id"].startswith("call_") and patch["status"] == "completed"
    assert "namespace" not in patch
    assert shell["type"] == "local_shell_call" and shell["call_id"].startswith("call_")
    assert shell["action"] == {"type": "exec", "command": ["cat", "a.txt"], "timeout_ms": 1000,
                               "working_directory": None, "env": {}, "user": None}
    assert (unknown["type"], unknown["name"]) == ("function_call", "no_such_tool")


@pytest.mark.parametrize("call", CALLS, ids=["function", "namespaced", "namespaced-custom", "custom",
                                             "local-shell", "unknown"])
def test_a_replayed_call_item_is_the_tool_call_the_model_wrote(call: ParsedToolCall) -> None:
    """What chains a turn onto the last: the assistant message its answer's items make back has the key
    of the message the model's text was parsed into (the same function name and arguments)."""
    item = call_item(call, tool_refs(CODEX_TOOLS))
    replayed = {key: value for key, value in item.items() if key not in ("id", "status")}  # as Codex sends
    (message,) = items_to_messages(None, [replayed])
    written_call = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    written = {"role": "assistant", "content": None, "tool_calls": [written_call]}
    assert message_key(message) == message_key(written)
    assert message["tool_calls"][0]["id"] == item["call_id"]


def test_custom_input_of_another_shape_is_passed_on_as_written() -> None:
    refs = tool_refs([PATCH])
    assert call_item(ParsedToolCall("apply_patch", '"just text"'), refs)["input"] == "just text"
    assert call_item(ParsedToolCall("apply_patch", '{"patch": 1}'), refs)["input"] == '{"patch": 1}'
    shell_refs = tool_refs([{"type": "local_shell"}])
    no_command = call_item(ParsedToolCall("local_shell", '{"cmd": "ls"}'), shell_refs)
    assert (no_command["type"], no_command["name"]) == ("function_call", "local_shell")


def test_codex_history_items_become_chat_messages() -> None:
    items = [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "d"}]},
        {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "u"}]},
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{}",
         "call_id": "c1"},
        {"type": "custom_tool_call", "status": "completed", "call_id": "c2", "name": "apply_patch",
         "input": "*** Begin Patch"},
        {"type": "local_shell_call", "call_id": None, "id": "c3", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "timeout_ms": None, "working_directory": "/w",
                    "env": {}, "user": None}},
        {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done!"},
        {"type": "local_shell_call_output", "id": "c3", "output": "a.txt"},
    ]
    assert items_to_messages(None, items) == [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent",
                                                          "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "apply_patch",
                                                          "arguments": '{"input": "*** Begin Patch"}'}},
            {"id": "c3", "type": "function", "function": {
                "name": "local_shell", "arguments": '{"command": ["ls"], "working_directory": "/w"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "spawned"},
        {"role": "tool", "tool_call_id": "c2", "content": "Done!"},
        {"role": "tool", "tool_call_id": "c3", "content": "a.txt"},
    ]


@pytest.mark.parametrize("item", [
    {"type": "custom_tool_call", "call_id": "c", "name": "p", "input": {"not": "text"}},
    {"type": "custom_tool_call", "call_id": "c", "input": "x"},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 7},
    {"type": "local_shell_call", "call_id": "c", "action": {"type": "exec"}},
    {"type": "custom_tool_call_output", "output": "x"},
], ids=["custom-input-not-text", "custom-without-name", "namespace-not-text", "shell-without-command",
        "output-without-call-id"])
def test_malformed_call_items_are_400s_naming_the_item(item: dict[str, Any]) -> None:
    with pytest.raises(OpenAIError) as error:
        items_to_messages(None, [{"role": "user", "content": "q"}, item])
    assert error.value.status == 400 and error.value.param == "input[1]"


def test_text_format_is_the_chat_response_format() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True},
            "verbosity": "low"}
    assert chat_response_format(text) == {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": schema, "strict": True}}
    assert chat_response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert chat_response_format({"format": {"type": "text"}}) == {"type": "text"}
    assert chat_response_format(None) is None and chat_response_format({"verbosity": "low"}) is None
    for bad in ({"type": "json_schema", "schema": schema}, {"type": "grammar"}, "json"):
        with pytest.raises(OpenAIError) as error:
            chat_response_format({"format": bad})
        assert error.value.param == "text.format"


def test_a_codex_request_is_a_chat_request_with_flattened_tools_and_its_format() -> None:
    raw = {
        "model": "m", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k", "client_metadata": {"thread_id": "t"}, "tools": CODEX_TOOLS,
        "text": {"format": {"type": "json_object"}},
        "input": [{"type": "message", "id": "msg_1", "role": "user",
                   "content": [{"type": "input_text", "text": "hi"}]}],
    }
    chat = chat_request(ResponsesRequest.model_validate(raw), [], raw)
    messages, tools = chat.template_input()
    assert messages == [{"role": "user", "content": "hi"}]
    assert [tool["function"]["name"] for tool in tools or []] == [
        "exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__note", "apply_patch", "local_shell"]
    assert chat.model_dump(exclude_none=True)["response_format"] == {"type": "json_object"}
    assert chat.tool_choice == "auto"
    assert json.loads(json.dumps(raw)) == raw  # the request itself is recorded as sent
