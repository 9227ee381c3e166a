"""`POST /v1/chat/completions`: render the prompt token-exactly, generate on a worker, record the
completion, then answer (as one JSON object, or as a stream).

Which session a completion belongs to: the session of the session key. An admin key has no session, so
each admin call gets its own session, created for that call, ended as soon as its completions are
recorded, and named in the `x-flywheel-session-id` response header (reward it or its completions
through the RL API like any other).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from proxy.auth import SESSION_KEY_PREFIX, Principal, generate_api_key, require_principal
from proxy.balancer import Worker
from proxy.config import ProxyConfig
from proxy.conversation_text import ConversationKeys
from proxy.conversations import ConversationPrompt, conversation_prompt
from proxy.errors import OpenAIError
from proxy.generation import ChoiceResult, GenerationPlan, generate, open_stream, plan_generation
from proxy.online import online_session
from proxy.parsers import OutputParser, reasoning_parser, tool_call_parser
from proxy.request_body import decoded_body, validated_body
from proxy.responses import chat_completion, completion_records
from proxy.schemas import ChatCompletionRequest
from proxy.services import ProxyServices
from proxy.sse_response import EventStreamResponse
from proxy.streaming import DONE, ChatStream
from proxy.tokenize import ChatTokenizer
from storage.queries import create_session, end_session, hash_api_key
from storage.records import CompletionRecord, SessionRecord

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-flywheel-session-id"
ADMIN_CALL_ORIGIN = "admin-call"

_PROMPT_TAIL_TOKENS = 8  # enough to see whether the prompt ends by opening a <think> block
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_chat_completion(request: Request) -> Response:
    # Taken by hand (decoded once), in FastAPI's order: unparsable JSON, the key, then the body's fields.
    request_json = await decoded_body(request)
    principal = await require_principal(request)
    services: ProxyServices = request.app.state.services
    body = validated_body(request_json, ChatCompletionRequest)
    messages, tools = body.template_messages(), body.template_tools()  # once: both steps read them
    session_id = await call_session_id(services, principal, messages, tools)
    conversation = await chat_prompt(services, principal, session_id, messages, tools)
    prompt_ids = conversation.prompt_ids
    plan = plan_generation(
        body, prompt_ids, services.tokenizer, services.config.default_max_tokens, session_id,
        services.served_model_name, output_parser(body, services.config, services.tokenizer, prompt_ids),
    )
    plan = in_conversation(plan, conversation)
    if conversation.new_from:
        # A child stores only its new messages; the parent chain holds the rest (DESIGN.md §5).
        request_json = {**request_json, "messages": request_json["messages"][conversation.new_from:]}
    end_call_session = await open_call_session(services, session_id) if principal.is_admin else None
    headers = {SESSION_HEADER: session_id}
    if body.streaming:
        worker, stream, first = await open_call_stream(services, plan, end_call_session)
        chat_stream = ChatStream(services, plan, body, request_json, worker, stream, first, end_call_session)
        return EventStreamResponse(
            chat_stream.events(), chat_stream.stop_reading, {**SSE_HEADERS, **headers}, last_event=DONE
        )
    return await answer_json(_complete(services, plan, body, request_json), end_call_session, headers)


async def call_session_id(
    services: ProxyServices, principal: Principal, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str:
    """The session a call belongs to: its session key's; for an online key, the session whose conversation
    it extends (or a new one, proxy/online.py); for an admin key, a new one-off session (created with
    `open_call_session` once the request is known to be valid)."""
    if principal.session_id is not None:
        return principal.session_id
    if principal.scope == "online":
        return await online_session(services, principal, messages, tools)
    return uuid.uuid4().hex


async def chat_prompt(
    services: ProxyServices, principal: Principal, session_id: str, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> ConversationPrompt:
    """The prompt of a chat call's template messages and tools: chained in its session's conversation
    tree; an admin call's one-off session has no history, so it is rendered as it is."""
    if not principal.is_admin:
        return await conversation_prompt(services, session_id, messages, tools)
    ids = await services.tokenizer.render_async(messages, tools, services.config.tokenize_in_thread_chars)
    return ConversationPrompt(ids)


def in_conversation(plan: GenerationPlan, conversation: ConversationPrompt) -> GenerationPlan:
    """The plan with its call's place in the session's conversation tree (parent, shared prefix, branch
    flag, and the message keys its record is indexed by)."""
    return replace(plan, parent_id=conversation.parent_id, prefix_len=conversation.prefix_len,
                   branched=conversation.branched, conversation_keys=conversation.keys)


async def open_call_stream(
    services: ProxyServices, plan: GenerationPlan, end_call_session: Callable[[], Awaitable[None]] | None
) -> tuple[Worker, AsyncGenerator[dict[str, Any], None], dict[str, Any]]:
    """`open_stream`; an admin call's one-off session is ended if no stream could be opened."""
    try:
        return await open_stream(services.balancer, plan)
    except OpenAIError:
        if end_call_session is not None:
            await end_call_session()
        raise


async def answer_json(
    complete: Awaitable[dict[str, Any]],
    end_call_session: Callable[[], Awaitable[None]] | None,
    headers: dict[str, str],
) -> Response:
    """Await the recorded response object and answer it as JSON; an admin call's one-off session is
    ended whether or not that worked."""
    try:
        response_json = await complete
    finally:
        if end_call_session is not None:
            await end_call_session()
    return Response(msgspec.json.encode(response_json), media_type="application/json", headers=headers)


async def _complete(
    services: ProxyServices, plan: GenerationPlan, body: ChatCompletionRequest, request_json: dict[str, Any]
) -> dict[str, Any]:
    """Generate, record, and return the response object; 500 if it could not be recorded."""
    results = await generate(services.balancer, plan)
    response_json = chat_completion(plan, results, body, services.tokenizer)
    records = completion_records(plan, results, request_json, response_json)
    await record_before_answer(services, records, plan.conversation_keys)
    count_generated(services, plan, results)
    return response_json


async def record_before_answer(
    services: ProxyServices, records: list[CompletionRecord], keys: ConversationKeys | None = None
) -> None:
    """Record the completions of a non-streaming answer; 500 (and no answer) if they cannot be."""
    try:
        await services.recorder.record(records, keys)
    except Exception as exc:
        raise OpenAIError(
            500, "The completion could not be recorded, so it is not returned.", "server_error",
            code="record_failed",
        ) from exc


def count_generated(services: ProxyServices, plan: GenerationPlan, results: list[ChoiceResult]) -> None:
    metrics = services.metrics
    for result in results:
        metrics.completions.labels(result.finish_reason).inc()
    metrics.tokens.labels("prompt").inc(len(plan.prompt_ids))
    metrics.tokens.labels("completion").inc(sum(len(result.output_ids) for result in results))


def output_parser(
    body: ChatCompletionRequest, config: ProxyConfig, tokenizer: ChatTokenizer, prompt_ids: list[int]
) -> OutputParser:
    """How this request's generated text becomes its message: the configured parsers, tool calls only
    when tools are offered, and at most one call with `parallel_tool_calls: false`."""
    if body.offers_tools and body.tool_choice not in (None, "auto"):
        # Decoding is not constrained (the CPU engine cannot); the output is parsed as with "auto".
        logger.debug("tool_choice %r is parsed as 'auto'", body.tool_choice)
    reasoning = reasoning_parser(config.reasoning_parser)
    in_reasoning = reasoning is not None and reasoning.starts_in_reasoning(
        tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    )
    return OutputParser(
        tools=tool_call_parser(config.tool_call_parser) if body.offers_tools else None,
        reasoning=reasoning,
        in_reasoning=in_reasoning,
        max_tool_calls=1 if body.parallel_tool_calls is False else None,
    )


async def open_call_session(services: ProxyServices, session_id: str) -> Callable[[], Awaitable[None]]:
    """Create the session of one admin call; return the function that ends it."""
    # A session needs a key to exist; nobody ever learns this one.
    key_hash = hash_api_key(generate_api_key(SESSION_KEY_PREFIX))
    await create_session(
        services.session_factory,
        SessionRecord(
            id=session_id,
            key_hash=key_hash,
            # Nobody rewards a one-off admin call: never train on it (the finalizer honours this).
            metadata={"origin": ADMIN_CALL_ORIGIN, "missing_reward": "drop"},
        ),
    )

    async def end_call_session() -> None:
        await end_session(services.session_factory, session_id)

    return end_call_session
