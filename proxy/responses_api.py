"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API on the chat pipeline.

The request becomes a chat request (proxy.responses_api_input), which is rendered, planned and generated
like a chat completion, with the same output parsers; the answer is a `response` object
(proxy.responses_api_output), streamed as named events (proxy.responses_api_stream). Each call is one
recorded completion whose id is the response's `resp_…` id; its request_json and response_json are the
stored response: `GET /v1/responses/{id}` answers the response_json, and `previous_response_id` puts the
earlier request's input (and, recursively, its own previous response's) and output before this input.
The prompt is chained in the session's conversation tree like a chat call's (proxy/conversations.py;
proxy.responses_api_record says what a Responses call adds to it). Stored responses are visible to
their own session's key and to admin keys; `store: false` ones to nobody (the completion is still
recorded for training).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from fastapi import Depends, Request
from fastapi.responses import Response
from sqlalchemy import select

from proxy.auth import Principal, require_principal
from proxy.chat import (
    SESSION_HEADER,
    SSE_HEADERS,
    answer_json,
    call_session_id,
    chat_prompt,
    count_generated,
    in_conversation,
    open_call_session,
    open_call_stream,
    output_parser,
    record_before_answer,
)
from proxy.errors import OpenAIError
from proxy.generation import GenerationPlan, generate, plan_generation
from proxy.request_body import decoded_body, validated_body
from proxy.responses import completion_records
from proxy.responses_api_input import ResponsesRequest, chat_request
from proxy.responses_api_output import RESPONSE_PREFIX, complete_response, new_response_id
from proxy.responses_api_record import CHAT_VIEW, chat_view
from proxy.responses_api_stream import ResponsesStream
from proxy.schemas import ChatCompletionRequest
from proxy.services import ProxyServices, get_services
from proxy.sse_response import EventStreamResponse
from storage.models import Completion

MAX_CHAIN = 1000  # previous_response_id links followed; a longer chain is refused, never looped over


async def create_response(request: Request) -> Response:
    # Taken by hand (decoded once), in FastAPI's order: unparsable JSON, the key, then the body's fields.
    request_json = await decoded_body(request)
    principal = await require_principal(request)
    services: ProxyServices = request.app.state.services
    body = validated_body(request_json, ResponsesRequest)
    history = await previous_items(services, principal, body.previous_response_id)
    chat = chat_request(body, history, request_json)
    messages, tools = chat.template_messages(), chat.template_tools()  # once: several steps read them
    session_id = await call_session_id(services, principal, messages, tools)
    conversation = await chat_prompt(services, principal, session_id, messages, tools)
    prompt_ids = conversation.prompt_ids
    plan = plan_generation(
        chat, prompt_ids, services.tokenizer, services.config.default_max_tokens, session_id,
        services.served_model_name, output_parser(chat, services.config, services.tokenizer, prompt_ids),
        completion_ids=(new_response_id(),), prompt_param="input",
    )
    plan = in_conversation(plan, conversation)
    # The request as sent (for GET and previous_response_id), and for the conversation tree the chat
    # messages this call adds to its parent's history.
    request_json = {**request_json, CHAT_VIEW: chat_view(messages[conversation.new_from:], tools)}
    end_call_session = await open_call_session(services, session_id) if principal.is_admin else None
    headers = {SESSION_HEADER: session_id}
    if not body.streaming:
        complete = _complete(services, plan, body, chat, request_json)
        return await answer_json(complete, end_call_session, headers)
    worker, stream, first = await open_call_stream(services, plan, end_call_session)
    responses_stream = ResponsesStream(
        services, plan, body, chat, request_json, worker, stream, first, end_call_session
    )
    return EventStreamResponse(
        responses_stream.events(), responses_stream.stop_reading, {**SSE_HEADERS, **headers}
    )


async def _complete(
    services: ProxyServices, plan: GenerationPlan, body: ResponsesRequest, chat: ChatCompletionRequest,
    request_json: dict[str, Any],
) -> dict[str, Any]:
    """Generate, record, and return the response object; 500 if it could not be recorded."""
    results = await generate(services.balancer, plan)
    response_json = complete_response(plan, body, results[0], services.tokenizer, chat.wants_logprobs)
    await record_before_answer(services, completion_records(plan, results, request_json, response_json))
    count_generated(services, plan, results)
    return response_json


async def retrieve_response(
    response_id: str,
    principal: Annotated[Principal, Depends(require_principal)],
    services: Annotated[ProxyServices, Depends(get_services)],
) -> Response:
    row = await stored_response(services, principal, response_id, param=None)
    return Response(msgspec.json.encode(row.response_json), media_type="application/json")


async def stored_response(
    services: ProxyServices, principal: Principal, response_id: str, param: str | None
) -> Completion:
    """The recorded completion of a stored response the caller may see; 404 otherwise (another
    session's response is as unknown as a missing one)."""
    row = None
    if response_id.startswith(RESPONSE_PREFIX):
        async with services.session_factory() as db:
            found = await db.execute(select(Completion).where(Completion.id == response_id))
            row = found.scalar_one_or_none()
    visible = (
        row is not None
        and principal.may_act_on(row.session_id)
        and row.response_json.get("object") == "response"
        and row.request_json.get("store") is not False
    )
    if not visible or row is None:
        raise OpenAIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                          param=param, code="response_not_found")
    return row


async def previous_items(
    services: ProxyServices, principal: Principal, response_id: str | None
) -> list[dict[str, Any]]:
    """The input and output items of `response_id` and of the responses it continued, oldest first.
    As on OpenAI, their `instructions` and `tools` are not carried over: only this request's count."""
    turns: list[list[dict[str, Any]]] = []
    while response_id is not None:
        if len(turns) >= MAX_CHAIN:
            raise OpenAIError(400, f"previous_response_id chains longer than {MAX_CHAIN} are not supported.",
                              "invalid_request_error", param="previous_response_id")
        row = await stored_response(services, principal, response_id, param="previous_response_id")
        request_input = row.request_json.get("input")
        items = [{"role": "user", "content": request_input}] if isinstance(request_input, str) else list(
            request_input or []
        )
        turns.append([*items, *row.response_json.get("output", [])])
        response_id = row.request_json.get("previous_response_id")
    return [item for turn in reversed(turns) for item in turn]
