"""`POST /v1/chat/completions`: the chat API on the call pipeline (proxy/openai/pipeline.py). Its messages
and tools are the call's conversation, rendered token-exactly in the session's tree; its answer is a
`chat.completion` object, or a stream of `chat.completion.chunk`s with parsed content, reasoning and
tool calls."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from proxy.config import ProxyConfig
from proxy.errors import OpenAIError
from proxy.openai.chat_objects import (
    chat_completion,
    chunk,
    finish_reason,
    logprob_entries,
    tool_call_id,
    usage,
)
from proxy.openai.pipeline import CallContext, CallSession, Part, PlannedCall
from proxy.openai.schemas import ChatCompletionRequest
from proxy.openai.sse import DONE, sse
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.parsers import (
    ANY_OBJECT_SCHEMA,
    Constraint,
    ConstraintError,
    ContentDelta,
    FunctionSpec,
    OutputParser,
    ReasoningDelta,
    StreamEvent,
    reasoning_parser,
    tool_call_parser,
)
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, read_choice
from proxy.workers.resume_stream import ResumingStream

logger = logging.getLogger(__name__)

_PROMPT_TAIL_TOKENS = 8  # enough to see whether the prompt ends by opening a <think> block


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """A conversation call planned as a chat request: its session, its one generation, and the chat
    messages and tools its prompt was rendered from."""

    session: CallSession
    part: Part
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


async def plan_chat(
    call: CallContext, chat: ChatCompletionRequest, completion_ids: tuple[str, ...] | None = None,
    prompt_param: str = "messages",
) -> ChatPlan:
    """The steps every conversation API shares once its request is a chat request (chat itself, and the
    Responses and Messages APIs after translating): the session the conversation belongs to, the prompt
    chained in it, and the generation with the chat request's output parser."""
    messages, tools = await call.prepare(chat.template_input)  # once: several steps read them
    session = await call.conversation_session(messages, tools)
    conversation = await call.prompt(session, messages, tools)
    prompt_ids = conversation.prompt_ids
    services = call.services
    parser = output_parser(chat, services.config, services.tokenizer, prompt_ids)
    plan = call.plan(chat, prompt_ids, session, parser, completion_ids, prompt_param)
    return ChatPlan(session, Part(plan, conversation), messages, tools)


class ChatApi:
    """Chat completions: request → plan."""

    body_model = ChatCompletionRequest

    async def plan(
        self, call: CallContext, body: ChatCompletionRequest, request_json: dict[str, Any]
    ) -> ChatCall:
        planned = await plan_chat(call, body)
        new_from = planned.part.conversation.new_from
        if new_from:
            # A child stores only its new messages; the parent chain holds the rest.
            request_json = {**request_json, "messages": request_json["messages"][new_from:]}
        return ChatCall(planned.session, [planned.part], request_json, body.streaming, body,
                        call.services.tokenizer)


@dataclass(eq=False)
class ChatCall(PlannedCall):
    """A planned chat call: results → `chat.completion` and its chunks."""

    body: ChatCompletionRequest
    tokenizer: ChatTokenizer

    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        return chat_completion(self.parts[0].plan, results[0], self.body, self.tokenizer)

    def stream(
        self, services: StreamServices, part: Part, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> GenerationStream:
        return ChatStream(services, self, stream, first, body)

    def closing(self, ended: list[tuple[int, list[ChoiceResult]]]) -> list[bytes]:
        events = []
        if self.body.include_usage:
            plan = self.parts[0].plan
            final = chunk(plan, [], include_usage=False)
            final["usage"] = usage(len(plan.prompt_ids), [r for _, results in ended for r in results])
            events.append(sse(final))
        return [*events, DONE]


def output_parser(
    body: ChatCompletionRequest, config: ProxyConfig, tokenizer: ChatTokenizer, prompt_ids: list[int]
) -> OutputParser:
    """How this request's generated text becomes its message: the configured parsers, tool calls only
    when tools are offered, at most one call with `parallel_tool_calls: false`, and the grammar the
    worker must follow, if the request asks for one."""
    constraint = decoding_constraint(body, config)
    # A constrained output is all answer (JSON, or calls): no reasoning block is split off it.
    reasoning = reasoning_parser(config.reasoning_parser) if constraint is None else None
    in_reasoning = reasoning is not None and reasoning.starts_in_reasoning(
        tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    )
    return OutputParser(
        tools=tool_call_parser(config.tool_call_parser) if body.offers_tools else None,
        reasoning=reasoning,
        in_reasoning=in_reasoning,
        max_tool_calls=1 if body.parallel_tool_calls is False else None,
        constraint=constraint,
    )


def decoding_constraint(body: ChatCompletionRequest, config: ProxyConfig) -> Constraint | None:
    """The grammar the worker enforces: `response_format`'s JSON, else a forced tool call in the
    configured tool-call format. As in SGLang, `response_format` wins over a forced tool call."""
    forced = forced_functions(body)
    requested = body.response_format.constraint() if body.response_format is not None else None
    if requested is not None or forced is None:
        if forced is not None:
            logger.debug("tool_choice %r is not enforced: response_format constrains the output",
                         body.tool_choice)
        return requested
    functions, several = forced
    try:
        return tool_call_parser(config.tool_call_parser).forced_calls(functions, several=several)
    except ConstraintError as exc:
        raise OpenAIError(400, str(exc), "invalid_request_error", param=exc.param) from None


def forced_functions(body: ChatCompletionRequest) -> tuple[list[FunctionSpec], bool] | None:
    """What `tool_choice` forces: the functions one of which must be called, and whether more calls
    may follow (`required` unless `parallel_tool_calls: false`); None when nothing is forced."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    name = _named_function(choice)
    if not body.tools:
        raise _tool_choice_error(f"tool_choice {choice!r} needs 'tools' to choose from.")
    functions = [FunctionSpec(tool.function.name, tool.function.parameters or ANY_OBJECT_SCHEMA)
                 for tool in body.tools]
    if name is None:
        return functions, body.parallel_tool_calls is not False
    named = [function for function in functions if function.name == name]
    if not named:
        raise _tool_choice_error(f"tool_choice names function {name!r}, which is not in 'tools'.")
    return named[:1], False


def _named_function(choice: str | dict[str, Any]) -> str | None:
    """The function a named choice names; None for "required"; a 400 for anything else."""
    if choice == "required":
        return None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise _tool_choice_error("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}.")


def _tool_choice_error(message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param="tool_choice", code="invalid_value")


class ChatStream(GenerationStream):
    """A streaming chat completion: `chat.completion.chunk`s with parsed content, reasoning and tool
    calls."""

    def __init__(
        self, services: StreamServices, call: ChatCall, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> None:
        part = call.parts[0]
        plan = part.plan
        self.body = call.body
        self._parsers = [plan.output.stream() for _ in range(plan.n)]
        self._parsed = [False] * plan.n
        self._logprobs_sent = [0] * plan.n
        self._call_ids: list[list[str]] = [[] for _ in range(plan.n)]
        super().__init__(services, plan, call.request_json, stream, first, self.body.stop_strings(), body,
                         part.conversation)

    def _opening(self) -> None:
        for choice in self.choices:
            self._emit([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])

    def _emit(self, choices: list[dict[str, Any]]) -> None:
        self._queue.put_nowait(sse(chunk(self.plan, choices, self.body.include_usage)))

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        choice = self._choice_of(worker_chunk)
        delta, _start, end = choice.advance(worker_chunk)
        parser = self._parsers[choice.index]
        events = parser.feed(delta) if delta else []
        if choice.finished and not self._parsed[choice.index]:
            self._parsed[choice.index] = True
            events += parser.finish()
        deltas = [d for event in events for d in self._deltas(choice.index, event)]
        reported = self._logprobs_sent[choice.index]
        if not deltas:
            if not (choice.finished and end > reported):
                return  # the text of these tokens is held back: their logprobs go with it
            deltas = [{"content": ""}]  # tokens with no text (an end-of-sequence token)
        logprobs = None
        if self.body.wants_logprobs and end > reported:
            partial = read_choice(worker_chunk, choice.index, final=False)
            top = partial.top_logprobs[reported:end] if partial.top_logprobs else None
            content = logprob_entries(self.services.tokenizer, partial.output_ids[reported:end],
                                      partial.logprobs[reported:end], top, self.body.top_logprobs or 0)
            logprobs = {"content": content, "refusal": None}
        self._logprobs_sent[choice.index] = max(end, reported)
        self._note_content()
        for position, delta_json in enumerate(deltas):
            self._emit([{"index": choice.index, "delta": delta_json,
                         "logprobs": logprobs if position == 0 else None, "finish_reason": None}])

    def _deltas(self, index: int, event: StreamEvent) -> list[dict[str, Any]]:
        """OpenAI's deltas for one parser event. A tool call is two: its id and name with empty
        arguments, then the arguments (later deltas carry only the index and argument text)."""
        if isinstance(event, ContentDelta):
            return [{"content": event.text}]
        if isinstance(event, ReasoningDelta):
            return [{"reasoning_content": event.text}]
        call_id = tool_call_id()
        self._call_ids[index].append(call_id)
        opening = {"index": event.index, "id": call_id, "type": "function",
                   "function": {"name": event.call.name, "arguments": ""}}
        arguments = {"index": event.index, "function": {"arguments": event.call.arguments}}
        return [{"tool_calls": [opening]}, {"tool_calls": [arguments]}]

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return chat_completion(self.plan, results, self.body, self.services.tokenizer,
                               dict(enumerate(self._call_ids)))

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        for result in results:
            reason = finish_reason(result.finish_reason, bool(self._call_ids[result.index]))
            self._emit([{"index": result.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
