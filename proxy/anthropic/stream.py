"""A streamed Messages API call: the worker's stream relayed as Anthropic's named SSE events, on the shared
streaming relay (`GenerationStream`: the worker read and then recorded by one task, abort on a dropped
client) and the incremental output parsers chat streaming uses.

`message_start` (the message with no content) and a `ping` open it. Blocks open as the parser finds
them and close when the next one starts: thinking (`thinking_delta`s), text (`text_delta`s), and each
tool call, which the parser yields whole (its input as one `input_json_delta`). Once the call is
recorded, `message_delta` (stop reason, stop sequence, output tokens) and `message_stop` end it; a
failure is one `error` event in Anthropic's shape.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

from proxy.anthropic.output import (
    matched_stop,
    message_object,
    new_tool_use_id,
    stop_reason,
    text_block,
    thinking_block,
    tool_use_block,
    usage,
)
from proxy.anthropic.record import request_answered
from proxy.errors import OpenAIError, anthropic_error_body
from proxy.openai.pipeline import Part
from proxy.openai.sse import named_sse
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.parsers import ContentDelta, StreamEvent, ToolCallDelta
from proxy.recording.records import completion_records
from proxy.workers.plan import ChoiceResult
from proxy.workers.resume_stream import ResumingStream
from storage.records import CompletionRecord

logger = logging.getLogger(__name__)

MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
"""The last event of every stream that ends normally."""
_DELTA_FIELDS = {"text": "text_delta", "thinking": "thinking_delta"}


class MessagesStream(GenerationStream):
    """One streaming `POST /v1/messages`."""

    def __init__(
        self, services: StreamServices, part: Part, request_json: dict[str, Any],
        stop_sequences: Sequence[str], stream: ResumingStream, first: dict[str, Any], body: StreamBody,
    ) -> None:
        self._stop_sequences = list(stop_sequences)
        self._parser = part.plan.output.stream()
        self._parsed = False
        self._blocks: list[dict[str, Any]] = []  # every block opened so far, in content order
        self._open: dict[str, Any] | None = None  # the text or thinking block still receiving deltas
        self._final: dict[str, Any] | None = None
        super().__init__(services, part.plan, request_json, stream, first, self._stop_sequences, body,
                         part.conversation)

    def _send(self, event_type: str, **fields: Any) -> None:
        self._queue.put_nowait(named_sse(event_type, {"type": event_type, **fields}))

    def _opening(self) -> None:
        self._send("message_start", message=message_object(self.plan, [], None, None, usage(self.plan, [])))
        self._send("ping")

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        choice = self.choices[0]
        delta, _start, _end = choice.advance(worker_chunk)
        events = self._parser.feed(delta) if delta else []
        if choice.finished and not self._parsed:
            self._parsed = True
            events += self._parser.finish()
        for event in events:
            self._relay(event)

    def _relay(self, event: StreamEvent) -> None:
        if isinstance(event, ToolCallDelta):
            self._close_open()
            block = tool_use_block(new_tool_use_id(), event.call)
            index = self._start(block, {**block, "input": {}})
            self._send("content_block_delta", index=index,
                       delta={"type": "input_json_delta", "partial_json": event.call.arguments})
            self._send("content_block_stop", index=index)
            return
        if not event.text:
            return
        self._note_content()
        kind = "text" if isinstance(event, ContentDelta) else "thinking"
        if self._open is None or self._open["type"] != kind:
            self._close_open()
            opened = text_block("") if isinstance(event, ContentDelta) else thinking_block("")
            self._start(opened, copy.deepcopy(opened))
            self._open = opened
        self._open[kind] += event.text
        self._send("content_block_delta", index=len(self._blocks) - 1,
                   delta={"type": _DELTA_FIELDS[kind], kind: event.text})

    def _start(self, block: dict[str, Any], shown: dict[str, Any]) -> int:
        """Open `block` (the client sees `shown`, its empty start); its index."""
        self._blocks.append(block)
        index = len(self._blocks) - 1
        self._send("content_block_start", index=index, content_block=shown)
        return index

    def _close_open(self) -> None:
        block, self._open = self._open, None
        if block is not None:
            self._send("content_block_stop", index=self._blocks.index(block))

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """The recorded message: the blocks as streamed."""
        content = copy.deepcopy(self._blocks)
        called = any(block["type"] == "tool_use" for block in content)
        result = results[0] if results else None
        stop = matched_stop(result, self._stop_sequences, self.services.tokenizer) if result else None
        reason = stop_reason(result.finish_reason if result else "abort", called, stop)
        self._final = message_object(self.plan, content, reason, stop, usage(self.plan, results))
        return self._final

    def _records(self, results: list[ChoiceResult], response: dict[str, Any]) -> list[CompletionRecord]:
        return completion_records(self.plan, results, request_answered(self.request_json, response), response,
                                  self.conversation)

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        final = self._final if self._final is not None else self._response(results)
        self._close_open()
        self._send("message_delta", delta={"stop_reason": final["stop_reason"],
                                           "stop_sequence": final["stop_sequence"]},
                   usage={"output_tokens": final["usage"]["output_tokens"]})
        self._queue.put_nowait(MESSAGE_STOP)

    def _fail(self, error: OpenAIError | None, exc: BaseException) -> None:
        """An `error` event in Anthropic's shape (an unnamed OpenAI-shaped one would be skipped)."""
        logger.error("stream %s failed: %s", self.plan.response_id, exc)
        if error is None:
            error = OpenAIError(500, "The server had an error while processing your request.", "server_error")
        self._queue.put_nowait(named_sse("error", anthropic_error_body(error.status, error.message)))
