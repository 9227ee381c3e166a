"""Real streaming: relay a worker's cumulative `/generate` stream to the client as OpenAI chunks, token by
token as they arrive, and record the completion when the stream ends. Chunks that queued up unread (the
proxy fell behind the worker) go out as one delta: the newest cumulative chunk holds them all.

The worker is read by its own task, not by the response body: when the client drops the stream, the
body generator is cancelled, the task's reading is stopped (closing the worker connection aborts the
generation there; an explicit `/abort_request` follows), and the same task then still records what was
generated, with finish_reason "abort". A stream that ends normally is recorded before its final
chunks and `data: [DONE]` go out, so a client that saw the end can rely on the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from proxy.balancer import Worker
from proxy.errors import OpenAIError, error_body
from proxy.generation import ChoiceResult, GenerationPlan, read_choice, worker_error
from proxy.parsers import ContentDelta, ReasoningDelta, StreamEvent
from proxy.responses import (
    chat_completion,
    chunk,
    completion_records,
    finish_reason,
    logprob_entries,
    tool_call_id,
    usage,
)
from proxy.resume_stream import ResumingStream
from proxy.schemas import ChatCompletionRequest
from proxy.services import ProxyServices
from serving.errors import WorkerError

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_ABORT_TIMEOUT_S = 5.0


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class ChoiceStream:
    """What one choice has sent so far. Text is sent only when it is final: never a trailing U+FFFD
    (an incomplete UTF-8 character the worker will complete) and never a tail that could begin a stop
    string (the worker trims a matched stop string from its final text)."""

    def __init__(self, index: int, stop_strings: list[str]) -> None:
        self.index = index
        self.stop_strings = stop_strings
        self.sent_text = ""
        self.sent_tokens = 0
        self.last: dict[str, Any] | None = None
        self.finished = False

    def advance(self, worker_chunk: dict[str, Any]) -> tuple[str, int, int]:
        """Take the worker's cumulative chunk; return (new text to send, first and end token of the
        tokens it covers)."""
        self.last = worker_chunk
        self.finished = bool((worker_chunk.get("meta_info") or {}).get("finish_reason"))
        text = str(worker_chunk.get("text", ""))
        if not text.startswith(self.sent_text):
            logger.warning("worker revised text already streamed (choice %d); keeping what was sent",
                           self.index)
            return "", self.sent_tokens, self.sent_tokens
        sendable = text if self.finished else self._settled(text)
        delta = sendable[len(self.sent_text):]
        n_tokens = len(worker_chunk.get("output_ids") or ())
        if not delta and not self.finished:
            return "", self.sent_tokens, self.sent_tokens  # tokens wait for the text they make
        start, self.sent_tokens = self.sent_tokens, n_tokens
        self.sent_text = sendable
        return delta, start, n_tokens

    def _settled(self, text: str) -> str:
        end = len(text)
        while end > len(self.sent_text) and text[end - 1] == "\ufffd":
            end -= 1
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, end - len(self.sent_text)), 0, -1):
                if text[end - size:end] == stop[:size]:
                    end -= size
                    break
        return text[:end]


class GenerationStream:
    """One streaming generation: the task that reads the worker and then records, and the SSE body.
    Subclasses say what the client sees: `_opening` (chunks before any token), `_take` (one worker
    chunk), `_response` (the object recorded for the results) and `_emit_end` (the last chunks)."""

    def __init__(
        self, services: ProxyServices, plan: GenerationPlan, request_json: dict[str, Any], worker: Worker,
        stream: AsyncGenerator[dict[str, Any], None], first: dict[str, Any], stop_strings: list[str],
        on_recorded: Callable[[], Awaitable[None]] | None = None,
        queue: asyncio.Queue[bytes | None] | None = None, first_index: int = 0,
    ) -> None:
        """`queue` is the response body's, shared when several streams make one response (each stream
        puts None in it when it is done); `first_index` is the response's index of choice 0."""
        self.services = services
        self.plan = plan
        self.request_json = request_json
        self.worker = worker
        self.choices = [ChoiceStream(i, stop_strings) for i in range(plan.n)]
        self._stream = stream
        self._first = first
        self._on_recorded = on_recorded
        self._first_index = first_index
        self._queue: asyncio.Queue[bytes | None] = queue if queue is not None else asyncio.Queue()
        self._started = time.perf_counter()
        self._first_content = True
        self._reading = True  # the task is reading the worker: a disconnect may stop that
        self._stopped = False
        self._read_scope: asyncio.Timeout | None = None
        services.spawn(self._run(), name=f"stream-{plan.response_id}")

    def _opening(self) -> None:
        """Chunks sent before the first token (none unless a subclass says so)."""

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        """Relay one cumulative worker chunk to the client."""
        raise NotImplementedError

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """The response object recorded with the results (what a non-streaming call would answer)."""
        raise NotImplementedError

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        """The last chunks (finish reasons, usage) and `data: [DONE]`, once the results are recorded."""
        raise NotImplementedError

    def _choice_of(self, worker_chunk: dict[str, Any]) -> ChoiceStream:
        return self.choices[int(worker_chunk.get("index", 0)) if self.plan.n > 1 else 0]

    def _note_content(self) -> None:
        """Time to first token, observed when the first content goes out."""
        if self._first_content:
            self._first_content = False
            self.services.metrics.time_to_first_token.observe(time.perf_counter() - self._started)

    async def events(self) -> AsyncIterator[bytes]:
        """The response body. If the client leaves, this generator is cancelled: stop the reader.
        Chunks queued together go out as one write: each ASGI send is a socket write, which costs more
        than the chunk itself, and SSE readers parse the bytes the same however they are split."""
        queue = self._queue
        try:
            while (item := await queue.get()) is not None:
                if queue.empty():
                    yield item
                    continue
                parts = [item]
                while not queue.empty() and (item := queue.get_nowait()) is not None:
                    parts.append(item)
                yield b"".join(parts)
                if item is None:
                    return
        finally:
            self.stop_reading()

    def stop_reading(self) -> None:
        """The client left: stop reading the worker (the task then records what was generated)."""
        if not self._reading or self._stopped:
            return
        self._stopped = True
        self.services.metrics.stream_disconnects.inc()
        if self._read_scope is not None:
            self._read_scope.reschedule(asyncio.get_running_loop().time())  # expire it now

    async def _run(self) -> None:
        """Read the worker's stream, then record and end the response, in one task (app shutdown waits
        for it). A disconnect ends only the reading (its scope expires): what was generated is still
        recorded."""
        aborted = self._stopped
        failure: BaseException | None = None
        if not aborted:
            try:
                async with asyncio.timeout(None) as scope:
                    self._read_scope = scope
                    # Queued by this task, not by the request's: the body then finds them beside the
                    # first tokens and sends all in one write (each write wakes the client).
                    self._opening()
                    await self._read()
            except TimeoutError as exc:
                aborted = scope.expired() and self._stopped
                failure = None if aborted else exc
            except Exception as exc:  # a task boundary: the failure is reported by _conclude
                failure = exc
        self._reading = False
        try:
            await self._conclude(aborted, failure)
        except Exception as exc:  # a task boundary: say what happened, to the log and the client
            logger.exception("stream %s could not be finished", self.plan.response_id)
            self._fail(None, exc)
        finally:
            await self._release_worker()
            self._queue.put_nowait(None)

    async def _read(self) -> None:
        async with contextlib.aclosing(self._stream):
            self._take(self._first)
            async for worker_chunk in self._stream:
                self._take(worker_chunk)

    async def _release_worker(self) -> None:
        """A `ResumingStream` holds its own worker lease (closing it again is harmless); a bare worker
        stream's lease is the balancer's."""
        if isinstance(self._stream, ResumingStream):
            await self._stream.aclose()
        else:
            self.services.balancer.release(self.worker)

    @property
    def current_worker(self) -> Worker:
        """The worker generating now (a resumed stream may have moved to another)."""
        if isinstance(self._stream, ResumingStream) and self._stream.worker is not None:
            return self._stream.worker
        return self.worker

    async def _conclude(self, aborted: bool, failure: BaseException | None) -> None:
        if aborted or failure is not None:
            await self._abort_worker()
        results = self._results(aborted or failure is not None)
        if not await self._record(results):
            return
        if failure is not None:
            self._fail(_client_error(failure), failure)
        elif not aborted:
            self._emit_end(results)

    def _results(self, interrupted: bool) -> list[ChoiceResult]:
        results = []
        for choice in self.choices:
            if choice.last is None:
                continue
            result = read_choice(choice.last, choice.index, final=not interrupted)
            if interrupted and not choice.finished:
                result = _as_aborted(result)
            results.append(result)
        return results

    async def _record(self, results: list[ChoiceResult]) -> bool:
        response = self._response(results)
        records = completion_records(self.plan, results, self.request_json, response, self._first_index)
        try:
            await self.services.recorder.record(records, self.plan.conversation_keys)
        except Exception as exc:
            self._fail(OpenAIError(500, "The completion could not be recorded.", "server_error",
                                   code="record_failed"), exc)
            return False
        for result in results:
            self.services.metrics.completions.labels(result.finish_reason).inc()
        self.services.metrics.tokens.labels("prompt").inc(len(self.plan.prompt_ids))
        self.services.metrics.tokens.labels("completion").inc(sum(len(r.output_ids) for r in results))
        if self._on_recorded is not None:
            await self._on_recorded()
        return True

    def _fail(self, error: OpenAIError | None, exc: BaseException) -> None:
        logger.error("stream %s failed: %s", self.plan.response_id, exc)
        if error is None:
            error = OpenAIError(500, "The server had an error while processing your request.", "server_error")
        self._queue.put_nowait(sse(error_body(error.message, error.type, error.param, error.code)))

    async def _abort_worker(self) -> None:
        """Closing the connection already aborts on SGLang; say it explicitly too, per sample."""
        rids = {c.last["meta_info"].get("id") for c in self.choices
                if c.last is not None and not c.finished and c.last.get("meta_info")}
        worker = self.current_worker
        for rid in filter(None, rids):
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT_S):
                    await worker.client.abort_request(rid=rid)
            except (WorkerError, TimeoutError) as exc:
                logger.info("could not abort %s on %s: %s", rid, worker.url, exc)


class ChatStream(GenerationStream):
    """A streaming chat completion: `chat.completion.chunk`s with parsed content, reasoning and tool
    calls."""

    def __init__(
        self, services: ProxyServices, plan: GenerationPlan, body: ChatCompletionRequest,
        request_json: dict[str, Any], worker: Worker, stream: AsyncGenerator[dict[str, Any], None],
        first: dict[str, Any], on_recorded: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.body = body
        self._parsers = [plan.output.stream() for _ in range(plan.n)]
        self._parsed = [False] * plan.n
        self._logprobs_sent = [0] * plan.n
        self._call_ids: list[list[str]] = [[] for _ in range(plan.n)]
        super().__init__(
            services, plan, request_json, worker, stream, first, body.stop_strings(), on_recorded
        )

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
        if self.body.include_usage:
            final = chunk(self.plan, [], include_usage=False)
            final["usage"] = usage(len(self.plan.prompt_ids), results)
            self._queue.put_nowait(sse(final))
        self._queue.put_nowait(DONE)


def _client_error(failure: BaseException) -> OpenAIError | None:
    if isinstance(failure, OpenAIError):
        return failure
    if isinstance(failure, WorkerError):
        return worker_error(failure)
    return None


def _as_aborted(result: ChoiceResult) -> ChoiceResult:
    return ChoiceResult(
        index=result.index, text=result.text, output_ids=result.output_ids, logprobs=result.logprobs,
        versions=result.versions, finish_reason="abort", top_logprobs=result.top_logprobs,
        worker_rid=result.worker_rid,
    )
