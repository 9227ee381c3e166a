"""The one call pipeline of the OpenAI surface. Every inference call, whichever API it speaks, goes key →
limits → read and decode → validate → session → prompt → plan → generate or stream → record → answer
here, with one place for each decision: which session a call belongs to, when a one-off session is
created and ended, how a failure is answered, what is recorded before the answer.

Each API (chat completions, legacy completions, the Responses API) is an `Api`: it turns a valid request
into a `PlannedCall` ("request → plan"), and its `PlannedCall` turns results into the response object,
the records and the stream's events ("results → response"). Nothing here knows an API's wire format.

Which session a call belongs to (`CallSession`):
- a session key: its own session;
- an online key: with a conversation hint (the `X-Flywheel-Conversation` header), the active session it
  owns with that hint, else a new one with it; without one, for a conversation call, the active session
  without a hint it owns whose conversation the call extends (proxy/conversations/online.py), else a new
  session owned by the key, which ends the key's older unhinted sessions
  (`proxy.online.end_on_new_conversation`, in the background); a raw-prompt call is a conversation of
  its own. A session or admin key's hint is ignored;
- an admin key: a one-off session, ended as soon as the call's completions are recorded and never
  trained on. The `x-flywheel-session-id` header names it (reward it through the RL API like any other).
A new session is created only once the request is known to be valid and planned.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response

from proxy.auth import Principal, require_principal
from proxy.conversations.online import CONVERSATION_HEADER, conversation_hint, find_online_session
from proxy.conversations.prompt import ConversationPrompt
from proxy.errors import OpenAIError
from proxy.openai.request_body import parsed_body
from proxy.openai.schemas import CallBody
from proxy.openai.sse import DONE, EventStreamResponse
from proxy.openai.streaming import (
    GenerationStream,
    StreamBody,
    StreamServices,
    record_failed,
    start_streams,
)
from proxy.parsers import OutputParser
from proxy.recording.records import NO_CONVERSATION, completion_records
from proxy.services import ProxyServices
from proxy.sessions import ADMIN_CALL_ORIGIN, ONLINE_ORIGIN, Origin, create_hidden_session, new_session_id
from proxy.workers.calls import generate, open_stream
from proxy.workers.plan import ChoiceResult, GenerationPlan, SamplingRequest, plan_generation
from proxy.workers.resume_stream import ResumingStream
from rewards.hooks.spec import stored_hooks
from storage.online_sessions import ConversationTaken, hinted_session, older_unhinted_sessions
from storage.queries import end_session
from storage.records import CompletionRecord

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-flywheel-session-id"

Body = TypeVar("Body", bound=CallBody)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallSession:
    """The session a call belongs to. `origin` is set for one the proxy creates for the call (once it is
    planned): a one-off admin call's, or a new conversation's on an online key (`owner`, and the call's
    `conversation` hint if it had one)."""

    id: str
    origin: Origin | None = None
    owner: str | None = None
    conversation: str | None = None

    @property
    def is_new(self) -> bool:
        return self.origin is not None

    @property
    def one_off(self) -> bool:
        """An admin call's session: no history, ended once the call is recorded."""
        return self.origin == ADMIN_CALL_ORIGIN


@dataclass(frozen=True, slots=True)
class Part:
    """One generation of a call (a legacy completion has one per prompt): its plan, its place in the
    session's conversation, and the response index of its choice 0."""

    plan: GenerationPlan
    conversation: ConversationPrompt = NO_CONVERSATION
    first_index: int = 0


class CallContext:
    """What an API's planning step may use: the services, the caller, and the call's session."""

    def __init__(
        self, services: ProxyServices, principal: Principal, large: bool = False, hint: str | None = None
    ) -> None:
        self.services = services
        self.principal = principal
        self.large = large
        """The body is larger than `proxy.parse_in_thread_bytes`: the call's work in proportion to its
        prompt (the template's messages, message keys, rendering) runs in worker threads, leaving the
        event loop to other calls."""
        self.hint = hint
        """An online key's conversation hint (`join_conversation` finds its session)."""
        self._hinted: CallSession | None = None
        self._release: Callable[[], None] | None = None

    async def join_conversation(self) -> None:
        """Find the session of the call's hint: the online key's active session with it, else a new one,
        reserved here until `settle` (calls with the same hint meanwhile wait for it, then join it)."""
        key_hash, hint = self.principal.key_hash, self.hint
        assert key_hash is not None and hint is not None
        services = self.services
        opening = services.new_conversations
        while True:
            await opening.settled(key_hash, hint)
            found = await hinted_session(services.session_factory, key_hash, hint)
            if found is not None:
                self._hinted = CallSession(found)
                return
            release = opening.reserve(key_hash, hint)
            if release is not None:  # else another call began opening it meanwhile: wait for that one
                self._release = release
                self._hinted = CallSession(new_session_id(), ONLINE_ORIGIN, key_hash, hint)
                return

    def settle(self) -> None:
        """The call's new hinted session exists now, or never will: the calls waiting for it go on."""
        if self._release is not None:
            self._release()
            self._release = None

    async def prepare(self, work: Callable[[], T]) -> T:
        """`work()`, in a worker thread for a large call."""
        return await asyncio.to_thread(work) if self.large else work()

    def new_session(self) -> CallSession:
        """The session of a call that extends no conversation: the session key's own, its hint's, else a
        new one."""
        principal = self.principal
        if self._hinted is not None:
            return self._hinted
        if principal.session_id is not None:
            return CallSession(principal.session_id)
        if principal.scope == "online":
            return CallSession(new_session_id(), ONLINE_ORIGIN, principal.key_hash)
        return CallSession(new_session_id(), ADMIN_CALL_ORIGIN)

    async def conversation_session(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> CallSession:
        """The session of a conversation call: an online key's call joins its hint's session, else the
        session whose conversation it extends, when one of the key's does."""
        principal = self.principal
        if self._hinted is not None:
            return self._hinted
        if principal.scope == "online" and principal.key_hash is not None:
            services = self.services
            found = await find_online_session(
                services.conversations, services.session_factory, principal.key_hash, messages, tools
            )
            if found is not None:
                return CallSession(found)
        return self.new_session()

    async def prompt(
        self, session: CallSession, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> ConversationPrompt:
        """The call's prompt, chained in its session's conversation (a one-off session has none)."""
        prompter = self.services.prompter
        if session.one_off:
            return await prompter.render(messages, tools, in_thread=self.large)
        return await prompter.prompt(session.id, messages, tools, new=session.is_new, in_thread=self.large)

    def plan(
        self, body: SamplingRequest, prompt_ids: list[int], session: CallSession,
        output: OutputParser | None = None, completion_ids: tuple[str, ...] | None = None,
        prompt_param: str = "messages",
    ) -> GenerationPlan:
        services = self.services
        return plan_generation(
            body, prompt_ids, services.tokenizer, services.config.default_max_tokens, session.id,
            services.model_name, output, completion_ids, prompt_param, services.lora_adapter,
        )


@dataclass(eq=False)
class PlannedCall(ABC):
    """A valid call, planned: its session, its generations, and the request its completions record.
    Subclasses (one per API) say what its results become."""

    session: CallSession
    parts: list[Part]
    request_json: dict[str, Any]
    """What each completion records as its request (a child stores only its new messages)."""
    streaming: bool
    """Answered as a stream of events (else as one JSON object)."""
    last_event: ClassVar[bytes | None] = DONE
    """The event that ends the API's streams (sent with the end of the response), if it has one."""

    @abstractmethod
    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        """The response object of a non-streaming call: `results[i]` are part i's choices."""

    def records(self, results: list[list[ChoiceResult]], response: dict[str, Any]) -> list[CompletionRecord]:
        """The completions the call records (one per choice of every part)."""
        return [
            record for part, choices in zip(self.parts, results, strict=True)
            for record in completion_records(part.plan, choices, self.request_json, response,
                                             part.conversation, part.first_index)
        ]

    @abstractmethod
    def stream(
        self, services: StreamServices, part: Part, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> GenerationStream:
        """The stream relaying one part's generation to the client."""

    def closing(self, ended: list[tuple[int, list[ChoiceResult]]]) -> list[bytes]:
        """The events after every part's stream ended normally (usage, `data: [DONE]`)."""
        return [DONE] if self.last_event == DONE else []


class Api(Protocol, Generic[Body]):
    """One API of the OpenAI surface: the body it validates, and its planning step."""

    body_model: type[Body]

    async def plan(self, call: CallContext, body: Body, request_json: dict[str, Any]) -> PlannedCall: ...


@dataclass(eq=False)
class _SessionEnd:
    """Ends a one-off session once, after the call's completions are recorded (or it failed)."""

    services: ProxyServices
    session_id: str
    done: bool = field(default=False)

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            await end_session(self.services.session_factory, self.session_id)


def endpoint(api: Api[Any]) -> Callable[[Request], Awaitable[Response]]:
    """The route handler serving `api`'s calls."""

    async def serve(request: Request) -> Response:
        return await serve_call(request, api)

    return serve


async def serve_call(request: Request, api: Api[Any]) -> Response:
    """Serve one inference call of `api` from its raw request."""
    # The key before the body is read (a bad key costs no read), then the body, decoded once, validated
    # and held to the limits before any work is done for it.
    principal = await require_principal(request)
    services: ProxyServices = request.app.state.services
    limiter = services.limiter
    limiter.admit(principal)  # 429 for a key over its rate or its tokens of the day, before any work
    count_tokens = limiter.counter(principal)  # None: the key has no daily quota, nothing to count
    # Only an online key's calls are grouped by conversation: any other key's hint is ignored.
    hint = None
    if principal.scope == "online":
        hint = conversation_hint(request.headers.get(CONVERSATION_HEADER))

    config = services.config
    request_json, body, large = await parsed_body(request, api.body_model, config.limits,
                                                  config.parse_in_thread_bytes)
    services.database.check()  # new work waits for a database that is down: 503 with Retry-After
    context = CallContext(services, principal, large, hint)
    calls = services.calls
    while True:
        try:
            if hint is not None:
                await context.join_conversation()
            call = await api.plan(context, body, request_json)
            session = call.session
            calls.enter(session.id)  # from here until recorded, the session's end waits for this call
            try:
                if session.is_new:
                    await _open_session(services, session)
                break
            except ConversationTaken:  # another proxy opened the hint's session first: plan in that one
                calls.leave(session.id)
            except BaseException:
                calls.leave(session.id)
                raise
        finally:
            context.settle()
    handed_over = False
    try:
        end = _SessionEnd(services, session.id) if session.one_off else None
        headers = {SESSION_HEADER: session.id}
        if call.streaming:
            response = await _stream(services, call, end, headers, functools.partial(calls.leave, session.id),
                                     count_tokens)
            handed_over = True  # the streams leave once recorded
            return response
        try:
            return await _answer(services, call, headers, count_tokens)
        finally:
            if end is not None:
                await end()
    finally:
        if not handed_over:
            calls.leave(session.id)


async def _open_session(services: ProxyServices, session: CallSession) -> None:
    """Create the call's new session; for a new unhinted conversation on an online key, end the key's
    older unhinted sessions in the background (`proxy.online.end_on_new_conversation`)."""
    assert session.origin is not None
    hooks = None
    if session.origin == ONLINE_ORIGIN:
        rewards = services.rewards
        hooks = stored_hooks(rewards.online_hooks, rewards.runner.max_attempts)
    await create_hidden_session(services.session_factory, session.origin, session.owner, session.id, hooks,
                                session.conversation)
    if (session.origin == ONLINE_ORIGIN and session.owner is not None and session.conversation is None
            and services.config.online.end_on_new_conversation):
        services.background.spawn(_end_older_sessions(services, session.owner, session.id),
                                   name=f"end sessions before {session.id}")


async def _end_older_sessions(services: ProxyServices, owner: str, newer: str) -> None:
    """End the online key's unhinted sessions older than its new one `newer`, as the RL API's end does:
    their hooks queued with the end, their finalization scheduled (it waits for their calls in flight).
    A failure is logged; those sessions then end by their TTL."""
    factory = services.session_factory
    try:
        for session_id in await older_unhinted_sessions(factory, owner, newer):
            if await end_session(factory, session_id):
                logger.info("session %s ended: its online key started a new conversation (%s)",
                            session_id, newer)
                if services.hook_runner is not None:
                    services.hook_runner.wake()
                services.finalizer.schedule(session_id)
    except Exception as exc:  # in the background: nobody to answer
        logger.warning("could not end the sessions older than %s (their TTL will): %s", newer, exc)


async def _answer(
    services: ProxyServices, call: PlannedCall, headers: dict[str, str],
    count_tokens: Callable[[int], None] | None,
) -> Response:
    """Generate every part, record every completion, then answer; 500 (and no answer) if the
    completions could not be recorded."""
    parts, balancer = call.parts, services.balancer
    if len(parts) == 1:  # no task for the common case: one more scheduling hop per call
        part = parts[0]
        results = [await generate(balancer, part.plan)]
        keys = part.conversation.keys
        prompt_tokens = len(part.plan.prompt_ids)
    else:
        results = list(await asyncio.gather(*(generate(balancer, part.plan) for part in parts)))
        keys = None
        prompt_tokens = sum(len(part.plan.prompt_ids) for part in parts)
    response = call.response(results)
    records = call.records(results, response)
    try:
        await services.recorder.record(records, keys, prompt_tokens)
    except Exception as exc:
        raise record_failed(exc, services.database.retry_after_s) from exc
    if count_tokens is not None:
        count_tokens(prompt_tokens + sum(len(record.output_ids) for record in records))
    return _json_response(msgspec.json.encode(response), headers)


def _json_response(content: bytes, headers: dict[str, str]) -> Response:
    """`content` as an application/json response with `headers`: Starlette's own length and type, the
    others appended (given to Response, they cost a round of encoding and checks per call)."""
    answer = Response(content, media_type="application/json")
    raw = answer.raw_headers
    for name, value in headers.items():
        raw.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return answer


async def _stream(
    services: ProxyServices, call: PlannedCall, end: _SessionEnd | None, headers: dict[str, str],
    on_finished: Callable[[], None], count_tokens: Callable[[int], None] | None,
) -> Response:
    """Open one worker stream per part (if one cannot be opened, those already open are closed and the
    call fails as a whole), then answer with their events as they come."""
    opened: list[tuple[ResumingStream, dict[str, Any]]] = []
    try:
        for part in call.parts:
            opened.append(await open_stream(services.balancer, part.plan))
    except OpenAIError:
        for stream, _first in opened:
            await stream.aclose()  # closes the worker connection (aborting there) and ends the lease
        if end is not None:
            await end()
        raise
    body = StreamBody(call.closing, end, on_finished)
    stream_services = StreamServices(services.recorder, services.metrics, services.tokenizer,
                                     services.background.spawn, services.database.retry_after_s, count_tokens)
    streams = [call.stream(stream_services, part, stream, first, body)
               for part, (stream, first) in zip(call.parts, opened, strict=True)]
    start_streams(streams)
    return EventStreamResponse(body.events(), body.stop_reading, headers,
                               last_event=call.last_event)
