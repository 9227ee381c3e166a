"""The bodies of `POST /v1/chat/completions` and `POST /v1/completions` as agents send them. Unknown
fields are ignored (OpenAI clients add new ones all the time); known fields with a wrong type or range
are a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 128
MAX_TOP_LOGPROBS = 20

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


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class SamplingFields(_Lenient):
    """The fields chat and legacy completions share: sampling, streaming, and the extensions vLLM and
    SGLang accept (`top_k`, `min_p`, `repetition_penalty`, `return_token_ids`), which clients send
    through `extra_body`."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (extra_body)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    return_token_ids: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and any(not s for s in stop):
            raise ValueError("stop sequences must not be empty")
        return stop

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    """OpenAI's chat completion request, plus the shared extensions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]

    @property
    def offers_tools(self) -> bool:
        """Tools reach the template and tool calls are parsed, unless `tool_choice` is "none".
        "required" and a named function are parsed as "auto": the CPU engine cannot constrain decoding."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or not self.offers_tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


LEGACY_MAX_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint's integer `logprobs`
LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for `POST /v1/completions`

Prompt = str | list[StrictInt]


class CompletionRequest(SamplingFields):
    """OpenAI's legacy `POST /v1/completions` request: `prompt` is a string, a list of token ids, or a
    batch (a list of either). Token ids are checked against the vocabulary by the route."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(None, ge=0, le=LEGACY_MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("a prompt must not be an empty list")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported by this server")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != (info.data.get("n") or 1):
            raise ValueError("best_of must equal n: this server returns every sample it generates")
        return best_of

    def prompts(self) -> list[Prompt]:
        """The batch: one string or one list of token ids per prompt."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else LEGACY_DEFAULT_MAX_TOKENS
