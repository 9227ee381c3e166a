"""The bodies of `POST /v1/chat/completions` and `POST /v1/completions` as agents send them. Unknown
fields are ignored (OpenAI clients add new ones all the time); known fields with a wrong type or range
are a 400 naming the field. Every number is bounded by what the workers accept and the database stores
(`top_k` is a 32-bit column, a seed 64 bits), so that a valid request cannot fail once it is generated;
the configurable caps (`proxy.limits`) are checked on the valid body, from its `call_size`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.conversations.messages import TemplateInput
from proxy.parsers import ANY_OBJECT_SCHEMA, Constraint, check_schema, json_constraint

INT32_MAX = 2**31 - 1
"""Bound of token counts, `n` and `top_k`: SGLang's integer fields and the 32-bit `completions.top_k`."""
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what SGLang's sampling_seed takes
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]

TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
"""A `logit_bias` key: a token id as a decimal string (checked against the vocabulary when planned)."""
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


@dataclass(frozen=True, slots=True)
class CallSize:
    """What a valid body asks of the proxy, measured before any work is done for it (and checked against
    `proxy.limits`)."""

    prompt_chars: int
    """Characters of text in its prompt(s), before tokenization."""
    prompt_param: str
    """The field that holds the prompt: `messages`, `prompt` or `input`."""
    n: int = 1
    """Choices per prompt."""
    prompts: int = 1
    top_logprobs: int = 0
    top_logprobs_param: str = "top_logprobs"


def json_text_chars(value: Any) -> int:
    """Characters of every string in decoded JSON (nested no deeper than `proxy.limits.max_json_depth`):
    the prompt size of a body whose text lies in nested items or blocks."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(json_text_chars(item) for item in value.values())
    if isinstance(value, list):
        return sum(json_text_chars(item) for item in value)
    return 0


class CallBody(_Lenient):
    """A request body of the call pipeline (proxy/openai/pipeline.py)."""

    def call_size(self) -> CallSize:
        """What the call asks for, checked against the limits before its work starts."""
        raise NotImplementedError


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class SamplingFields(CallBody):
    """The fields chat and legacy completions share: sampling, streaming, and the extensions vLLM and
    SGLang accept (`top_k`, `min_p`, `repetition_penalty`, `return_token_ids`), which clients send
    through `extra_body`."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[TokenId, Bias] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions (extra_body)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    """-1 (or absent): the whole vocabulary; else at least 1, as SGLang takes it."""
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    return_token_ids: bool | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, top_k: int | None) -> int | None:
        if top_k == 0:
            raise ValueError("top_k must be -1 (the whole vocabulary) or at least 1")
        return top_k

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


class JsonSchemaFormat(_Lenient):
    """`response_format.json_schema`: the schema every answer must match (always enforced, whatever
    `strict` says)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            check_schema(schema, "schema", "response_format")  # a ValueError: pydantic names the field
        return schema


class ResponseFormat(_Lenient):
    """`response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a 'json_schema' response format needs its 'json_schema' object")
        return self

    def constraint(self) -> Constraint | None:
        """The grammar the worker enforces (None for text): a schema without `schema` allows any JSON."""
        if self.type == "json_object":
            return json_constraint(ANY_OBJECT_SCHEMA)
        if self.type == "json_schema" and self.json_schema is not None:
            schema = self.json_schema.schema_
            return json_constraint(schema if schema is not None else {})
        return None


class ChatCompletionRequest(SamplingFields, TemplateInput):
    """OpenAI's chat completion request (its messages and tools: `TemplateInput`), plus the shared
    extensions."""

    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def call_size(self) -> CallSize:
        chars = sum(message.text_chars() for message in self.messages)
        return CallSize(chars, "messages", n=self.choices, top_logprobs=self.top_logprobs or 0)


LEGACY_MAX_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint's integer `logprobs`
LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for `POST /v1/completions`

Prompt = str | list[StrictInt]


class CompletionRequest(SamplingFields):
    """OpenAI's legacy `POST /v1/completions` request: `prompt` is a string, a list of token ids, or a
    batch (a list of either). Token ids are checked against the vocabulary by the route."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: int | None = Field(None, ge=0, le=LEGACY_MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=INT32_MAX)
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

    def call_size(self) -> CallSize:
        """Text prompts count in characters; token-id prompts are bounded by the context length."""
        prompts = self.prompts()
        chars = sum(len(prompt) for prompt in prompts if isinstance(prompt, str))
        return CallSize(chars, "prompt", n=self.choices, prompts=len(prompts),
                        top_logprobs=self.logprobs or 0, top_logprobs_param="logprobs")
