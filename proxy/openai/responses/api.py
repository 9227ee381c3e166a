"""`POST /v1/responses` and `GET /v1/responses/{id}`: OpenAI's Responses API on the call pipeline
(proxy/openai/pipeline.py).

The request becomes a chat request (responses/input.py), which is rendered, planned and generated like a
chat completion, with the same output parsers; the answer is a `response` object (responses/output.py),
streamed as named events (responses/stream.py). Each call is one recorded completion whose id is the
response's `resp_…` id; its request_json and response_json are the stored response:
`GET /v1/responses/{id}` answers the response_json, and `previous_response_id` puts the earlier
request's input (and, recursively, its own previous response's) and output before this input.
The prompt is chained in the session's conversation tree like a chat call's (responses/record.py says
what a Responses call adds to it). Stored responses are visible to their own session's key, to the
online key owning that session, and to admin keys; `store: false` ones to nobody (the completion is
still recorded for training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import Depends
from fastapi.responses import Response
from sqlalchemy import select

from proxy.auth import Principal, may_act_on, require_principal
from proxy.errors import OpenAIError
from proxy.openai.chat import plan_chat
from proxy.openai.pipeline import CallContext, Part, PlannedCall
from proxy.openai.responses.input import ResponsesRequest, chat_request
from proxy.openai.responses.output import RESPONSE_PREFIX, complete_response, new_response_id
from proxy.openai.responses.record import request_answered, request_with_view
from proxy.openai.responses.stream import ResponsesStream
from proxy.openai.schemas import ChatCompletionRequest
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.recording.records import completion_records
from proxy.recording.redaction import refuse_redacted
from proxy.services import ProxyServices, get_services
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult
from proxy.workers.resume_stream import ResumingStream
from storage.models import Completion
from storage.records import CompletionRecord

MAX_CHAIN = 1000  # previous_response_id links followed; a longer chain is refused, never looped over


class ResponsesApi:
    """The Responses API: request → plan (as the chat request its input items make)."""

    body_model = ResponsesRequest

    async def plan(
        self, call: CallContext, body: ResponsesRequest, request_json: dict[str, Any]
    ) -> ResponsesCall:
        services = call.services
        history = await previous_items(services, call.principal, body.previous_response_id)
        chat = await call.prepare(lambda: chat_request(body, history, request_json))
        planned = await plan_chat(call, chat, (new_response_id(),), prompt_param="input")
        # The request as sent (for GET and previous_response_id), and for the conversation tree the chat
        # messages this call adds to its parent's history.
        new_messages = planned.messages[planned.part.conversation.new_from:]
        recorded = request_with_view(request_json, new_messages, planned.tools)
        return ResponsesCall(planned.session, [planned.part], recorded, body.streaming, body, chat,
                             services.tokenizer)


@dataclass(eq=False)
class ResponsesCall(PlannedCall):
    """A planned Responses call: results → the `response` object and its named events."""

    body: ResponsesRequest
    chat: ChatCompletionRequest
    tokenizer: ChatTokenizer
    last_event = None  # a Responses stream ends with response.completed, not [DONE]

    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        return complete_response(self.parts[0].plan, self.body, results[0][0], self.tokenizer,
                                 self.chat.wants_logprobs)

    def records(self, results: list[list[ChoiceResult]], response: dict[str, Any]) -> list[CompletionRecord]:
        part = self.parts[0]
        return completion_records(part.plan, results[0], request_answered(self.request_json, response),
                                  response, part.conversation)

    def stream(
        self, services: StreamServices, part: Part, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> GenerationStream:
        return ResponsesStream(services, part, self.body, self.chat, self.request_json, stream, first, body)


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
    """The recorded completion of a stored response the caller may see (its session's key, the online
    key owning that session, an admin key: `may_act_on`); 404 otherwise (another session's response is
    as unknown as a missing one)."""
    row = None
    if response_id.startswith(RESPONSE_PREFIX):
        async with services.session_factory() as db:
            found = await db.execute(select(Completion).where(Completion.id == response_id))
            row = found.scalar_one_or_none()
    visible = (
        row is not None
        and row.response_json.get("object") == "response"
        and row.request_json.get("store") is not False
        and await may_act_on(services.session_factory, principal, row.session_id)
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
        refuse_redacted(row.request_json, response_id)  # its stored text is not what the model saw
        request_input = row.request_json.get("input")
        items = [{"role": "user", "content": request_input}] if isinstance(request_input, str) else list(
            request_input or []
        )
        turns.append([*items, *row.response_json.get("output", [])])
        response_id = row.request_json.get("previous_response_id")
    return [item for turn in reversed(turns) for item in turn]
