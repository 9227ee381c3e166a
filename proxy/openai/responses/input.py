"""The body of `POST /v1/responses` and its translation into a chat request: input items become chat
messages, the request's tools chat functions (responses/tools.py), `text.format` the chat
`response_format`, so the Responses API generates on the chat pipeline.

Items: messages (with or without `"type": "message"`; text parts only); the tool calls `function_call`
(a namespaced one under its template name), `custom_tool_call` and `local_shell_call`, each an assistant
tool call (consecutive calls and the assistant text before them make one assistant message, as chat
templates expect); their outputs `function_call_output`, `custom_tool_call_output` and
`local_shell_call_output`, each a tool message; and `reasoning` (its text becomes the `reasoning_content`
of the assistant message that follows it, which templates that render reasoning use and others ignore;
with no assistant message after it, or with only encrypted content, it is dropped). Anything else is a
400.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from proxy.errors import OpenAIError
from proxy.openai.responses.tools import (
    LOCAL_SHELL,
    chat_tool_choice,
    chat_tools,
    custom_arguments,
    flat_name,
    shell_arguments,
)
from proxy.openai.schemas import (
    INT32_MAX,
    CallBody,
    CallSize,
    ChatCompletionRequest,
    TokenCount,
    json_text_chars,
)

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# Sampling extensions a client may add through `extra_body`, passed on to the chat request as they are.
EXTENSION_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "seed", "stop", "logit_bias")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")
TEXT_FORMATS = ("text", "json_object")  # `text.format` types chat's `response_format` takes as they are


class ResponsesRequest(CallBody):
    """OpenAI's `POST /v1/responses` body. Unknown fields are ignored, as in the chat schema; `text`,
    `reasoning`, `include` and `truncation` are accepted and echoed (`text.format` is the chat request's
    `response_format`)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    max_output_tokens: TokenCount | None = None
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def call_size(self) -> CallSize:
        """The input's text is every string in its items (ids and types are short); the instructions
        are the prompt's too."""
        chars = json_text_chars(self.input) + len(self.instructions or "")
        return CallSize(chars, "input", top_logprobs=self.top_logprobs or 0)



def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], request_json: dict[str, Any]
) -> ChatCompletionRequest:
    """The chat request that generates this response: `history` (the items of a previous response)
    then this request's input, after `instructions` as a system message."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": items_to_messages(body.instructions, [*history, *body.input_items()]),
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "response_format": chat_response_format(body.text),
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "top_logprobs": body.top_logprobs,
        "logprobs": INCLUDE_LOGPROBS in (body.include or ()),
        "stream": body.stream,
        "user": body.user,
        **{name: request_json[name] for name in EXTENSION_FIELDS if name in request_json},
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # rendered as every other validation error (a 400 naming the field)
        raise RequestValidationError(exc.errors()) from None


def items_to_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (dicts for `ChatMessage`) of Responses input items."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning: str | None = None  # waits for the assistant message it belongs to
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise _item_error(index, "each input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning = "\n".join(_texts(item.get("content") or item.get("summary") or [], index)) or None
            continue
        if kind == "message":
            message = _message(item, index)
        elif kind in CALL_ITEMS:
            call = _tool_call(item, index)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind in OUTPUT_ITEMS:
            message = {"role": "tool", "tool_call_id": _call_id(item, index),
                       "content": _content_text(item.get("output"), index, "output")}
        else:
            raise _item_error(index, f"input items of type {kind!r} are not supported by this server",
                              code="unsupported_item_type")
        if message["role"] == "assistant" and reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
    return messages


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise _item_error(index, f"a message's role must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}")
    return {"role": role, "content": _content_text(item.get("content"), index, "content")}


def _tool_call(item: dict[str, Any], index: int) -> dict[str, Any]:
    """The chat tool call of a call item, named and with the arguments its answer had (responses/tools.py),
    so that a replayed call matches the generated one."""
    kind = item["type"]
    if kind == "local_shell_call":
        action = item.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("command"), list):
            raise _item_error(index, "a local_shell_call needs an 'action' with a 'command' list")
        name, arguments = LOCAL_SHELL, shell_arguments(action)
    else:
        field = "arguments" if kind == "function_call" else "input"
        text = item.get(field, "")
        if not isinstance(text, str):
            raise _item_error(index, f"a {kind}'s {field} must be a string")
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise _item_error(index, f"a {kind}'s namespace must be a string")
        name = flat_name(_string(item, "name", index), namespace)
        arguments = text if kind == "function_call" else custom_arguments(text)
    function = {"name": name, "arguments": arguments}
    return {"id": _call_id(item, index), "type": "function", "function": function}


def _call_id(item: dict[str, Any], index: int) -> str:
    """A call's (or its output's) `call_id`; local shell items may carry only their `id`."""
    if item["type"].startswith("local_shell") and not item.get("call_id"):
        return _string(item, "id", index)
    return _string(item, "call_id", index)


def _content_text(content: Any, index: int, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_texts(content, index))
    raise _item_error(index, f"{field} must be a string or a list of text parts")


def _texts(parts: list[Any], index: int) -> list[str]:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _item_error(index, f"content parts of type {kind!r} are not supported by this text-only "
                                     "model", code="unsupported_content_type")
    return texts


def _string(item: dict[str, Any], field: str, index: int) -> str:
    value = item.get(field)
    if not isinstance(value, str) or not value:
        raise _item_error(index, f"a {item.get('type')} item needs {field!r} as a non-empty string")
    return value


def _item_error(index: int, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, f"input[{index}]: {message}.", "invalid_request_error", param=f"input[{index}]",
                       code=code)


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's `response_format` of the Responses `text.format`: `text` and `json_object` as they are, a
    `json_schema` format with its `name`, `schema`, `description` and `strict` under `json_schema`."""
    format_ = (text or {}).get("format")
    if format_ is None:
        return None
    kind = format_.get("type") if isinstance(format_, dict) else None
    if kind in TEXT_FORMATS:
        return {"type": kind}
    named = kind == "json_schema" and isinstance(format_.get("name"), str)
    if named and isinstance(format_.get("schema"), dict):
        fields = ("name", "schema", "description", "strict")
        return {"type": "json_schema", "json_schema": {key: format_[key] for key in fields if key in format_}}
    raise OpenAIError(400, "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
                           "'json_schema', 'name', 'schema'}.", "invalid_request_error", param="text.format")
