"""The bodies of `POST /v1/chat/completions` and `POST /v1/completions` as agents send them. Unknown
fields are ignored (OpenAI clients add new ones all the time); known fields with a wrong type or range
are a 400 naming the field."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from proxy.conversations.messages import TemplateInput

MAX_N = 128
MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


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


class ChatCompletionRequest(SamplingFields, TemplateInput):
    """OpenAI's chat completion request (its messages and tools: `TemplateInput`), plus the shared
    extensions."""

    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
