"""The bodies of `POST /v1/messages` and `POST /v1/messages/count_tokens` as Anthropic's clients send them.
Content blocks, tools and the system prompt stay plain JSON here and are checked as they are translated
(proxy/anthropic/translate.py), so that a bad block is a 400 naming it. Unknown fields are ignored, as in
the chat schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.openai.schemas import INT32_MAX, CallBody, CallSize, TokenCount, json_text_chars


class ToolChoice(BaseModel):
    """`{type: auto | any | tool | none, name?, disable_parallel_tool_use?}`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's name")
        return self


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesInput(CallBody):
    """What both bodies share: the conversation, the tools and the system prompt."""

    model: str | None = None
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    """Accepted: whether the model reasons is up to it and `proxy.reasoning_parser` splits it out."""

    def call_size(self) -> CallSize:
        """The prompt's text is every string of its messages and system prompt (types and ids are short)."""
        chars = json_text_chars([message.content for message in self.messages]) + json_text_chars(self.system)
        return CallSize(chars, "messages")


class MessagesRequest(MessagesInput):
    """Anthropic's `POST /v1/messages` body."""

    max_tokens: TokenCount
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    """0 (as absent): the whole vocabulary."""
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    """Its `format` (`{type: json_schema, schema}`) is the chat request's `response_format`; its
    `effort` is accepted."""

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and any(not stop for stop in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def user_id(self) -> str | None:
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None


class CountTokensRequest(MessagesInput):
    """Anthropic's `POST /v1/messages/count_tokens` body: a request without its sampling fields."""

