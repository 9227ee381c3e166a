"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API on the call pipeline
(proxy/openai/pipeline.py).

The request becomes a chat request (proxy/anthropic/translate.py), which is rendered, chained in the
session's conversation tree, planned and generated like a chat completion, with the same output parsers;
the answer is a `message` object (proxy/anthropic/output.py), streamed as named events
(proxy/anthropic/stream.py). Each call is one recorded completion whose id is the message's `msg_…` id,
recorded with a chat view (proxy/anthropic/record.py) so that the next turn chains onto it.
`count_tokens` renders the prompt the same request would get, and generates and records nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from fastapi import Request
from fastapi.responses import Response

from proxy.anthropic.output import complete_message, new_message_id
from proxy.anthropic.record import recorded_request, request_answered
from proxy.anthropic.schemas import CountTokensRequest, MessagesRequest
from proxy.anthropic.stream import MESSAGE_STOP, MessagesStream
from proxy.anthropic.translate import chat_request, template_request
from proxy.auth import require_principal
from proxy.openai.chat import plan_chat
from proxy.openai.pipeline import CallContext, Part, PlannedCall
from proxy.openai.request_body import parsed_body
from proxy.openai.schemas import ChatCompletionRequest
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.recording.records import completion_records
from proxy.services import ProxyServices
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult
from proxy.workers.resume_stream import ResumingStream
from storage.records import CompletionRecord


class MessagesApi:
    """The Messages API: request → plan (as the chat request its messages make)."""

    body_model = MessagesRequest

    async def plan(
        self, call: CallContext, body: MessagesRequest, request_json: dict[str, Any]
    ) -> MessagesCall:
        services = call.services
        translation = await call.prepare(lambda: chat_request(body, request_json))
        chat = translation.chat
        planned = await plan_chat(call, chat, (new_message_id(),))
        recorded = recorded_request(request_json, translation.origins, planned.part.conversation.new_from,
                                    planned.messages, planned.tools)
        return MessagesCall(planned.session, [planned.part], recorded, body.streaming, chat,
                            services.tokenizer)


@dataclass(eq=False)
class MessagesCall(PlannedCall):
    """A planned Messages call: results → the `message` object and its named events."""

    chat: ChatCompletionRequest
    tokenizer: ChatTokenizer
    last_event: ClassVar[bytes | None] = MESSAGE_STOP

    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        return complete_message(self.parts[0].plan, results[0][0], self.tokenizer, self.chat.stop_strings())

    def records(self, results: list[list[ChoiceResult]], response: dict[str, Any]) -> list[CompletionRecord]:
        part = self.parts[0]
        return completion_records(part.plan, results[0], request_answered(self.request_json, response),
                                  response, part.conversation)

    def stream(
        self, services: StreamServices, part: Part, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> GenerationStream:
        return MessagesStream(services, part, self.request_json, self.chat.stop_strings(), stream, first,
                              body)


async def count_tokens(request: Request) -> Response:
    """`{"input_tokens": N}`: the tokens of the prompt the request renders to, tools included, as a new
    conversation's first call gets it (a chained call's prompt may keep tokens a fresh render drops)."""
    principal = await require_principal(request)
    services: ProxyServices = request.app.state.services
    services.limiter.admit(principal)  # rendering costs like a call's: the key's rate counts it
    config = services.config
    _payload, body, large = await parsed_body(request, CountTokensRequest, config.limits,
                                              config.parse_in_thread_bytes)
    context = CallContext(services, principal, large)
    chat = await context.prepare(lambda: template_request(body))
    messages, tools = await context.prepare(chat.template_input)
    prompt = await services.prompter.render(messages, tools, in_thread=large)
    answer = {"input_tokens": len(prompt.prompt_ids)}
    return Response(msgspec.json.encode(answer), media_type="application/json")
