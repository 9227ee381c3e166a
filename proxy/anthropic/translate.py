"""A Messages API request as a chat request, so it is rendered, planned and generated on the chat pipeline.

- `system` (a string or text blocks) becomes the system message.
- A user message's `tool_result` blocks become `tool` messages, in order, and its other blocks one user
  message after them; an assistant message's text and `tool_use` blocks one assistant message with
  content and tool calls (arguments: the input as JSON), its `thinking` blocks its `reasoning_content`
  (`redacted_thinking` holds no text and is dropped). Text blocks are joined by newlines, as chat's text
  parts are. Images and documents are a 400: the served model reads text only.
- Tools `{name, description, input_schema}` become function tools; Anthropic's server tools (those with a
  `type` such as `web_search_20250305`) run on Anthropic's side, so they are left out of the prompt.
- `tool_choice`: `any` is chat's `required`, `tool` a named function, `disable_parallel_tool_use` is
  `parallel_tool_calls: false`; `stop_sequences` are `stop`, `metadata.user_id` is `user`, and
  `output_config.format` (structured outputs) the `response_format`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from proxy.anthropic.schemas import MessagesInput, MessagesRequest, ToolChoice
from proxy.errors import OpenAIError
from proxy.openai.schemas import ChatCompletionRequest

# Sampling extensions a client may add through `extra_body`, passed on to the chat request as they are.
EXTENSION_FIELDS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                    "logit_bias")
CUSTOM_TOOL = "custom"
MEDIA_BLOCKS = ("image", "document")
SYSTEM_ORIGIN = -1
"""The origin of the system message: no message of the request."""


@dataclass(frozen=True, slots=True)
class Translation:
    """The chat request of a Messages request, and for each of its messages the index of the request
    message it came from (`SYSTEM_ORIGIN` for the system prompt)."""

    chat: ChatCompletionRequest
    origins: list[int]


def chat_request(body: MessagesRequest, request_json: dict[str, Any]) -> Translation:
    """The chat request that generates this message."""
    fields, origins = conversation_fields(body)
    fields.update({
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k or None,
        "stop": body.stop_sequences or None,
        "stream": body.stream,
        "user": body.user_id(),
        "response_format": chat_response_format(body.output_config),
        **{name: request_json[name] for name in EXTENSION_FIELDS if name in request_json},
    })
    return Translation(_validated(fields), origins)


def template_request(body: MessagesInput) -> ChatCompletionRequest:
    """The chat request of a `count_tokens` body: its conversation only."""
    return _validated(conversation_fields(body)[0])


def conversation_fields(body: MessagesInput) -> tuple[dict[str, Any], list[int]]:
    """The chat request's messages, tools and tool choice, and each message's origin."""
    messages, origins = chat_messages(body)
    tools = chat_tools(body.tools)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "tools": tools}
    if tools and body.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(body.tool_choice, tools)
        if body.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields, origins


def _validated(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # rendered as every other validation error (a 400 naming the field)
        raise RequestValidationError(exc.errors()) from None


def chat_messages(body: MessagesInput) -> tuple[list[dict[str, Any]], list[int]]:
    """Chat messages (dicts for `ChatMessage`) of the system prompt and the messages, with their origins."""
    messages: list[dict[str, Any]] = []
    origins: list[int] = []
    system = system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
        origins.append(SYSTEM_ORIGIN)
    tool_names: dict[str, str] = {}  # tool_use id → tool name, for the results that answer it
    for index, message in enumerate(body.messages):
        if message.role == "assistant":
            made = [assistant_message(message.content, f"messages[{index}].content")]
            for call in made[0].get("tool_calls") or ():
                tool_names[call["id"]] = call["function"]["name"]
        else:
            made = _user_messages(message.content, index, tool_names)
        messages += made
        origins += [index] * len(made)
    return messages, origins


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(_text(block, f"system[{index}]") for index, block in enumerate(system))


def _user_messages(content: str | list[dict[str, Any]], index: int, tool_names: dict[str, str]
                   ) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not content:
        raise _error(f"messages[{index}].content", "a message needs at least one content block")
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for position, block in enumerate(content):
        param = f"messages[{index}].content[{position}]"
        if _kind(block, param) == "tool_result":
            results.append(_tool_result(block, param, tool_names))
        else:
            texts.append(_text(block, param))
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def assistant_message(content: str | list[dict[str, Any]], param: str) -> dict[str, Any]:
    """The chat message of an assistant turn's content: what a client sends back, and what the proxy's
    own answer makes (proxy/anthropic/record.py), so that both key alike."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for position, block in enumerate(content):
        block_param = f"{param}[{position}]"
        kind = _kind(block, block_param)
        if kind == "tool_use":
            calls.append(_tool_call(block, block_param))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", block_param, allow_empty=True))
        elif kind != "redacted_thinking":
            texts.append(_text(block, block_param))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise _error(f"{param}.input", "a tool_use block's input must be an object")
    return {"id": _string(block, "id", param), "type": "function",
            "function": {"name": _string(block, "name", param),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], param: str, tool_names: dict[str, str]) -> dict[str, Any]:
    """A `tool` message; `is_error` has no chat counterpart and is left out (the text says what failed)."""
    call_id = _string(block, "tool_use_id", param)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text(part, f"{param}.content[{position}]") for position, part in enumerate(content))
    else:
        raise _error(f"{param}.content", "a tool_result's content must be a string or a list of text blocks")
    message: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in tool_names:
        message["name"] = tool_names[call_id]
    return message


def _kind(block: Any, param: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise _error(param, "a content block must be an object with a 'type'")
    return kind


def _text(block: Any, param: str) -> str:
    """The text of a text block; a 400 for any other kind of block."""
    kind = _kind(block, param)
    if kind != "text":
        reason = "the served model reads text only" if kind in MEDIA_BLOCKS else "not in this place"
        raise _error(param, f"content blocks of type {kind!r} are not supported ({reason})",
                     code="unsupported_content_type")
    return _string(block, "text", param, allow_empty=True)


def _string(block: dict[str, Any], field: str, param: str, allow_empty: bool = False) -> str:
    value = block.get(field)
    if not isinstance(value, str) or not (value or allow_empty):
        raise _error(f"{param}.{field}", f"a {block.get('type')} block needs {field!r} as a "
                                          f"{'' if allow_empty else 'non-empty '}string")
    return value


def _error(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}.", "invalid_request_error", param=param, code=code)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools of the custom tools; server tools are left out, None when none is left."""
    converted = []
    for index, tool in enumerate(tools or ()):
        if tool.get("type", CUSTOM_TOOL) != CUSTOM_TOOL:
            continue  # a server tool: Anthropic runs it, this server cannot
        param = f"tools[{index}]"
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _error(f"{param}.input_schema", "a tool needs its input_schema as a JSON Schema object")
        function: dict[str, Any] = {"name": _string(tool, "name", param), "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted or None


def chat_response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` of `output_config.format`, `{type: json_schema, schema}`."""
    format_ = (output_config or {}).get("format")
    if format_ is None:
        return None
    if not (isinstance(format_, dict) and format_.get("type") == "json_schema"
            and isinstance(format_.get("schema"), dict)):
        raise _error("output_config.format", "the output format must be {'type': 'json_schema', 'schema'}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": format_["schema"]}}


_CHOICES: dict[str, Callable[[ToolChoice], str | dict[str, Any]]] = {
    "auto": lambda _choice: "auto",
    "any": lambda _choice: "required",
    "none": lambda _choice: "none",
    "tool": lambda choice: {"type": "function", "function": {"name": choice.name}},
}


def chat_tool_choice(choice: ToolChoice, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    """Chat's `tool_choice` of Anthropic's; a named tool must be one of the offered tools."""
    if choice.type == "tool" and choice.name not in {tool["function"]["name"] for tool in tools}:
        raise _error("tool_choice.name", f"no tool named {choice.name!r} is offered")
    return _CHOICES[choice.type](choice)
