"""Chat messages and tools as agents send them and as the chat template renders them: the part of a
chat request that a conversation is made of (and that a recorded chat request is read back as)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    """One part of a message's content. Only text parts reach a text model."""

    type: str
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type == "text" and self.text is not None:
            return self
        if self.type == "refusal" and self.refusal is not None:
            return self
        if self.type in ("text", "refusal"):
            raise ValueError(f"a {self.type!r} part needs its {self.type!r} field as a string")
        raise ValueError(f"content parts of type {self.type!r} are not supported by this text-only model")

    @property
    def value(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role not in ("assistant",):
            raise ValueError(f"a {self.role!r} message needs content")
        return self

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines); None stays None."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.value for part in self.content)

    def text_chars(self) -> int:
        """Characters of text the message brings to a prompt (content, reasoning, tool-call arguments),
        counted without joining or rendering anything."""
        content = self.content
        chars = len(content) if isinstance(content, str) else sum(len(part.value) for part in content or ())
        chars += len(self.reasoning_content or "")
        for call in self.tool_calls or ():
            arguments = call.function.arguments
            chars += len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments))
        return chars

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: string content, tool-call arguments as objects."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed  # HF templates render arguments from a mapping
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: str = "function"
    function: FunctionDefinition


class TemplateInput(_Lenient):
    """What a chat template renders of a chat request: its messages and the tools it offers."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]

    def template_input(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(`template_messages()`, `template_tools()`), what a call renders."""
        return self.template_messages(), self.template_tools()

    @property
    def offers_tools(self) -> bool:
        """Tools reach the template and tool calls are parsed, unless `tool_choice` is "none" ("required"
        and a named function also constrain decoding: proxy/openai/chat.py)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or not self.offers_tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]
