"""Real streaming: relay a worker's cumulative `/generate` stream to the client, token by token as they
arrive, and record the completion when the stream ends. Chunks that queued up unread (the proxy fell
behind the worker) go out as one delta: the newest cumulative chunk holds them all.

The worker is read by its own task, not by the response body: when the client drops the stream, the
body generator is cancelled, the task's reading is stopped (closing the worker connection aborts the
generation there; an explicit `/abort_request` follows), and the same task then still records what was
generated, with finish_reason "abort". A stream that ends normally is recorded before its final
chunks go out, so a client that saw the end can rely on the record.

`StreamBody` is the response body of one streamed call; each of its `GenerationStream`s (one per
prompt: a legacy completion may have several) writes into it, and each API says in a subclass what the
client sees of its stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.conversations.prompt import ConversationPrompt
from proxy.errors import OpenAIError, error_body, unavailable_error
from proxy.metrics import ProxyMetrics
from proxy.openai.sse import sse
from proxy.recording.indexing import IndexingRecorder
from proxy.recording.records import NO_CONVERSATION, completion_records
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, GenerationPlan, read_choice, worker_error
from proxy.workers.resume_stream import ResumingStream
from serving.errors import WorkerError
from storage.errors import is_session_finalized, is_unavailable
from storage.records import CompletionRecord

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 5.0

Ended = tuple[int, list[ChoiceResult]]
"""A stream that ended normally: its response index of choice 0, and its results."""


@dataclass(frozen=True, slots=True)
class StreamServices:
    """What a generation stream uses of the proxy's services."""

    recorder: IndexingRecorder
    metrics: ProxyMetrics
    tokenizer: ChatTokenizer
    spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]
    retry_after_s: float
    """The Retry-After of a record that failed because the database is down."""
    count_tokens: Callable[[int], None] | None
    """Counts the tokens a recorded generation served against its caller's key's daily quota; None for a
    key without one."""


def record_failed(exc: BaseException, retry_after_s: float) -> OpenAIError:
    """The error of a call whose completions could not be recorded (so it is not answered as complete):
    503 with Retry-After when the database was down throughout the recorder's retries, else 500."""
    if is_unavailable(exc):
        return unavailable_error(retry_after_s)
    if is_session_finalized(exc):
        return OpenAIError(409, "The session was finalized before this call could be recorded, so it is "
                           "not returned (it would not be trained on).", "conflict_error",
                           code="session_finalized")
    return OpenAIError(500, "The completion could not be recorded, so it is not returned.", "server_error",
                       code="record_failed")


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


class EventQueue:
    """The events of one response body in order (None: one of its streams is done), and the future its
    reader waits on while there are none. What the body needs of an `asyncio.Queue` (unbounded, one
    reader) at a fraction of its cost per event: no size or task bookkeeping, no waiter queues."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[bytes | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: bytes | None) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # else the reader was cancelled
                waiter.set_result(None)


class StreamBody:
    """The response body of one streamed call. Its streams put events in one queue (and None when
    done); after the last of them ended normally come the `closing` events (usage, `data: [DONE]`);
    `on_recorded` runs after the last stream recorded (an admin call's one-off session then ends), and
    `on_finished` once every stream's task is done (the call no longer holds its session's end)."""

    def __init__(
        self, closing: Callable[[list[Ended]], list[bytes]],
        on_recorded: Callable[[], Coroutine[Any, Any, None]] | None = None,
        on_finished: Callable[[], None] | None = None,
    ) -> None:
        self.queue = EventQueue()
        self.streams: list[GenerationStream] = []
        self._closing = closing
        self._on_recorded = on_recorded
        self._on_finished = on_finished
        self._recorded = 0
        self._finished = 0
        self._ended: list[Ended] = []

    async def recorded(self) -> None:
        self._recorded += 1
        if self._recorded == len(self.streams) and self._on_recorded is not None:
            await self._on_recorded()

    def finished(self) -> None:
        """One stream's task is done (recorded, or failed); after the last, `on_finished`, and the body
        lets go of its streams: each refers to the body, and a cycle left standing would keep the whole
        call (request, results, records) alive until the garbage collector's next pass."""
        self._finished += 1
        if self._finished == len(self.streams):
            self.streams = []
            if self._on_finished is not None:
                self._on_finished()

    def ended(self, first_index: int, results: list[ChoiceResult]) -> None:
        """One stream ended normally; after the last, the closing events."""
        self._ended.append((first_index, results))
        if len(self._ended) == len(self.streams):
            for event in self._closing(sorted(self._ended, key=lambda ended: ended[0])):
                self.queue.put_nowait(event)

    async def events(self) -> AsyncIterator[bytes]:
        """The response body, until every stream is done. If the client leaves, this generator is
        cancelled: every stream stops reading. Events queued together go out as one write: each ASGI
        send is a socket write, which costs more than the event itself, and SSE readers parse the bytes
        the same however they are split."""
        queue = self.queue
        items = queue.items
        remaining = len(self.streams)
        loop = asyncio.get_running_loop()
        try:
            while remaining:
                while not items:
                    queue.waiter = waiter = loop.create_future()
                    await waiter
                item = items.popleft()
                if item is None:
                    remaining -= 1
                    continue
                if items:  # more were queued meanwhile: one write for all
                    parts = [item]
                    while items:
                        more = items.popleft()
                        if more is not None:
                            parts.append(more)
                            continue
                        remaining -= 1
                        if not remaining:
                            break
                    item = b"".join(parts)
                yield item
        finally:
            self.stop_reading()

    def stop_reading(self) -> None:
        """The client left: every stream stops reading its worker (and then records what it has)."""
        for stream in self.streams:
            stream.stop_reading()


class GenerationStream:
    """One streaming generation: the task that reads the worker and then records. Subclasses say what
    the client sees: `_opening` (events before any token), `_take` (one worker chunk), `_response` (the
    object recorded for the results) and `_emit_end` (the events after the results are recorded)."""

    def __init__(
        self, services: StreamServices, plan: GenerationPlan, request_json: dict[str, Any],
        stream: ResumingStream, first: dict[str, Any], stop_strings: list[str], body: StreamBody,
        conversation: ConversationPrompt = NO_CONVERSATION, first_index: int = 0,
    ) -> None:
        """`first_index` is the response's index of choice 0 (a batch of prompts)."""
        self.services = services
        self.plan = plan
        self.request_json = request_json
        self.conversation = conversation
        self.choices = [ChoiceStream(i, stop_strings) for i in range(plan.n)]
        self.first_index = first_index
        self._stream = stream
        self._first = first
        self._body = body
        self._queue = body.queue
        self._started = time.perf_counter()
        self._first_content = True
        self._reading = True  # the task is reading the worker: a disconnect may stop that
        self._stopped = False
        self._read_scope: asyncio.Timeout | None = None
        body.streams.append(self)

    def start(self) -> None:
        """Start the task that reads the worker, records and ends the stream."""
        self.services.spawn(self._run(), f"stream-{self.plan.response_id}")

    def _opening(self) -> None:
        """Events sent before the first token (none unless a subclass says so)."""

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        """Relay one cumulative worker chunk to the client."""
        raise NotImplementedError

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """The response object recorded with the results (what a non-streaming call would answer)."""
        raise NotImplementedError

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        """The stream's last events (finish reasons), once its results are recorded."""
        raise NotImplementedError

    def _records(self, results: list[ChoiceResult], response: dict[str, Any]) -> list[CompletionRecord]:
        return completion_records(self.plan, results, self.request_json, response, self.conversation,
                                  self.first_index)

    def _choice_of(self, worker_chunk: dict[str, Any]) -> ChoiceStream:
        return self.choices[int(worker_chunk.get("index", 0)) if self.plan.n > 1 else 0]

    def _note_content(self) -> None:
        """Time to first token, observed when the first content goes out."""
        if self._first_content:
            self._first_content = False
            self.services.metrics.time_to_first_token.observe(time.perf_counter() - self._started)

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
            await self._stream.aclose()  # ends the worker lease (closing it again is harmless)
            self._queue.put_nowait(None)
            self._body.finished()

    async def _read(self) -> None:
        stream = self._stream
        try:
            self._take(self._first)
            async for worker_chunk in stream:
                self._take(worker_chunk)
        finally:
            await stream.aclose()  # the worker connection and lease end before the record is written

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
            self._body.ended(self.first_index, results)

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
        records = self._records(results, self._response(results))
        try:
            await self.services.recorder.record(records, self.conversation.keys, len(self.plan.prompt_ids))
        except Exception as exc:
            # An error event instead of the stream's end: no client reports it as a completed answer.
            self._fail(record_failed(exc, self.services.retry_after_s), exc)
            return False
        count_tokens = self.services.count_tokens
        if count_tokens is not None:
            count_tokens(len(self.plan.prompt_ids) + sum(len(r.output_ids) for r in results))
        await self._body.recorded()
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
        worker = self._stream.worker
        if worker is None:
            return
        for rid in filter(None, rids):
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT_S):
                    await worker.client.abort_request(rid=rid)
            except (WorkerError, TimeoutError) as exc:
                logger.info("could not abort %s on %s: %s", rid, worker.url, exc)


def start_streams(streams: Sequence[GenerationStream]) -> None:
    """Start every stream of one body (after all joined it: the body counts them)."""
    for stream in streams:
        stream.start()


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
