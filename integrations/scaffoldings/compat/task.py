"""Tasks of the Scaffolding layer: what a controller yields and a worker fills in, with the field names
and factories of `tensorrt_llm.scaffolding.task`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from integrations.scaffoldings.compat.result import ScaffoldingOutput


@dataclass
class Task:
    """Base of every task; `worker_tag` names the worker role that runs it."""

    worker_tag: Any = None
    streaming_output_flag: bool = False
    streaming_output_list: list[Any] = field(default_factory=list)
    custom_input_params: dict[str, Any] | None = None
    custom_output_params: dict[str, Any] | None = None

    def create_scaffolding_output(self) -> ScaffoldingOutput:
        return ScaffoldingOutput("", [])


class TaskStatus(Enum):
    """What `Worker.run_task` answers. The misspelt member is the upstream name, kept for portability."""

    SUCCESS = "success"
    WORKER_NOT_SUPPORTED = "worker_not_supported"
    WORKER_EXECEPTION = "worker_exception"


@dataclass
class GenerationTask(Task):
    """One generation: a prompt (`input_str`), OpenAI-style sampling fields (None: the server's default)
    and the result fields a worker fills."""

    input_tokens: list[int] | None = None
    input_str: str | None = None
    skip_tokenizer: bool = False
    skip_detokenizer: bool = False

    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    num_logprobs: int | None = None
    max_tokens: int | None = None
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    return_context_logits: bool | None = False

    output_str: str | None = None
    output_tokens: list[int] | None = None
    finish_reason: str | None = None
    context_logits: Any = None
    logprobs: Any = None
    customized_result_fields: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def create_from_prompt(prompt: str) -> GenerationTask:
        return GenerationTask(input_str=prompt)

    def create_scaffolding_output(self) -> ScaffoldingOutput:
        return ScaffoldingOutput(self.output_str or "", list(self.output_tokens or []))


@dataclass
class StreamGenerationTask(GenerationTask):
    """A generation a worker may hand back in steps; this layer runs it to the end in one step."""

    cancel_flag: bool = False
    streaming_step: int = 1
    request_handle: Any = None
    end_flag: bool = False


@dataclass
class RoleMessage:
    role: str | None = None
    content: str | None = None
    prefix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoleMessage:
        return cls(role=data["role"], content=data["content"])


class UserMessage(RoleMessage):
    def __init__(self, content: str, prefix: str | None = None) -> None:
        super().__init__(role="user", content=content, prefix=prefix)


class SystemMessage(RoleMessage):
    def __init__(self, content: str, prefix: str | None = None) -> None:
        super().__init__(role="system", content=content, prefix=prefix)


class AssistantMessage(RoleMessage):
    def __init__(
        self, content: str | None, reasoning: str | None = None, reasoning_content: str | None = None,
        tool_calls: list[Any] | None = None,
    ) -> None:
        super().__init__(role="assistant", content=content)
        self.reasoning = reasoning
        self.reasoning_content = reasoning_content
        self.tool_calls = tool_calls


@dataclass
class ChatTask(StreamGenerationTask):
    """A conversation: a worker answers `messages` and appends its `AssistantMessage`."""

    messages: list[RoleMessage] = field(default_factory=list)
    tools: Any = None
    enable_token_counting: bool = False
    prompt_tokens_num: int = 0
    completion_tokens_num: int = 0
    sub_request_markers: list[tuple[str, int]] = field(default_factory=list)
    unique_id: int | None = None

    def messages_to_dict_content(self, start_index: int = 0) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages[start_index:] if m.content is not None]

    def add_message(self, message: RoleMessage) -> None:
        self.messages.append(message)

    def add_messages(self, messages: Sequence[RoleMessage]) -> None:
        self.messages.extend(messages)

    @staticmethod
    def create_from_prompt(
        user_prompt: str | None, system_prompts: Sequence[SystemMessage] | None = None, tools: Any = None
    ) -> ChatTask:
        task = ChatTask(messages=list(system_prompts or []), tools=tools)
        if user_prompt is not None:
            task.add_message(UserMessage(user_prompt))
        return task

    @staticmethod
    def create_from_messages(messages: list[RoleMessage], tools: Any = None) -> ChatTask:
        return ChatTask(messages=messages, tools=tools)
