"""A streamed Responses API call: the worker's stream relayed as named SSE events (`event: <type>` and a
`data:` object with a `sequence_number`), on the shared streaming relay (`GenerationStream`: the
worker read and then recorded by one task, abort on a dropped client) and the incremental output
parsers chat streaming uses.

Items open as the parser finds them and close when the next one starts: a reasoning item
(`response.reasoning_text.delta`), a message (`response.output_text.delta`), and each tool call, which
the parser yields whole: a function call (added, its arguments as one delta, done), a custom tool call
(added, its input as one `response.custom_tool_call_input.delta`, done) or a local shell call (added,
done). `response.completed` (or `response.incomplete` when `max_output_tokens` cut it) carries the full
response, once it is recorded.

With `include: ["message.output_text.logprobs"]` each text delta carries the logprobs of the tokens
generated since the previous one (markup and reasoning tokens included); the final message, as when not
streamed, carries every output token's.
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.openai.chat_objects import logprob_entries
from proxy.openai.pipeline import Part
from proxy.openai.responses.input import ResponsesRequest
from proxy.openai.responses.output import (
    call_item,
    item_status,
    message_item,
    new_item_id,
    reasoning_item,
    response_object,
    usage,
)
from proxy.openai.responses.record import request_answered
from proxy.openai.responses.tools import tool_refs
from proxy.openai.schemas import ChatCompletionRequest
from proxy.openai.sse import named_sse
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.parsers import ContentDelta, ParsedToolCall, ReasoningDelta, StreamEvent
from proxy.recording.records import completion_records
from proxy.workers.plan import ChoiceResult, read_choice
from proxy.workers.resume_stream import ResumingStream
from storage.records import CompletionRecord


class ResponsesStream(GenerationStream):
    """One streaming `POST /v1/responses` (a single choice)."""

    def __init__(
        self, services: StreamServices, part: Part, request: ResponsesRequest, chat: ChatCompletionRequest,
        request_json: dict[str, Any], stream: ResumingStream, first: dict[str, Any], body: StreamBody,
    ) -> None:
        self.body = request
        self._refs = tool_refs(request.tools)
        self._parser = part.plan.output.stream()
        self._parsed = False
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # every item opened so far, in output order
        self._open: dict[str, Any] | None = None  # the item still receiving text
        self._reasoning = ""
        self._final: dict[str, Any] | None = None
        self._top_logprobs = (chat.top_logprobs or 0) if chat.wants_logprobs else None
        self._logprobs_sent = 0  # output tokens whose logprobs went out with a text delta
        self._chunk_logprobs: list[dict[str, Any]] = []  # those of this chunk, for its first text delta
        super().__init__(services, part.plan, request_json, stream, first, chat.stop_strings(), body,
                         part.conversation)

    def _send(self, event_type: str, **fields: Any) -> None:
        payload = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        self._queue.put_nowait(named_sse(event_type, payload))

    def _opening(self) -> None:
        response = response_object(self.plan, self.body, [], None, None)
        self._send("response.created", response=response)
        self._send("response.in_progress", response=response)

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        choice = self.choices[0]
        delta, _start, end = choice.advance(worker_chunk)
        events = self._parser.feed(delta) if delta else []
        if choice.finished and not self._parsed:
            self._parsed = True
            events += self._parser.finish()
        if self._top_logprobs is not None and end > self._logprobs_sent:
            self._chunk_logprobs = self._logprob_entries(read_choice(worker_chunk, 0, final=False), end)
        for event in events:
            self._relay(event)

    def _relay(self, event: StreamEvent) -> None:
        if isinstance(event, ContentDelta | ReasoningDelta):
            if not event.text:
                return
            self._note_content()
            kind = "message" if isinstance(event, ContentDelta) else "reasoning"
            item = self._open if self._open is not None and self._open["type"] == kind else self._start(kind)
            item["content"][0]["text"] += event.text
            if kind == "reasoning":
                self._reasoning += event.text
            extra: dict[str, Any] = {}
            if kind == "message":  # the tokens since the last text delta (tool markup, reasoning too)
                extra["logprobs"], self._chunk_logprobs = self._chunk_logprobs, []
                self._logprobs_sent += len(extra["logprobs"])
            self._send(_delta_event(kind), item_id=item["id"], output_index=len(self._items) - 1,
                       content_index=0, delta=event.text, **extra)
            return
        self._call(event.call)

    def _call(self, parsed: ParsedToolCall) -> None:
        """One tool call's item, whole: added, its arguments or input as one delta, done."""
        self._close_open()
        call = call_item(parsed, self._refs)
        self._items.append(call)
        index = len(self._items) - 1
        ids = {"item_id": call["id"], "output_index": index}
        if call["type"] == "function_call":
            self._send("response.output_item.added", output_index=index,
                       item={**call, "arguments": "", "status": "in_progress"})
            self._send("response.function_call_arguments.delta", **ids, delta=call["arguments"])
            self._send("response.function_call_arguments.done", **ids, name=call["name"],
                       arguments=call["arguments"])
        elif call["type"] == "custom_tool_call":
            self._send("response.output_item.added", output_index=index,
                       item={**call, "input": "", "status": "in_progress"})
            self._send("response.custom_tool_call_input.delta", **ids, delta=call["input"])
            self._send("response.custom_tool_call_input.done", **ids, input=call["input"])
        else:
            self._send("response.output_item.added", output_index=index,
                       item={**call, "status": "in_progress"})
        self._send("response.output_item.done", output_index=index, item=call)

    def _logprob_entries(self, partial: ChoiceResult, end: int) -> list[dict[str, Any]]:
        start = self._logprobs_sent
        top = partial.top_logprobs[start:end] if partial.top_logprobs else None
        return logprob_entries(self.services.tokenizer, partial.output_ids[start:end],
                               partial.logprobs[start:end], top, self._top_logprobs or 0)

    def _start(self, kind: str) -> dict[str, Any]:
        """Close the open item and open a `kind` item (message or reasoning) with empty text."""
        self._close_open()
        if kind == "message":
            item = message_item(new_item_id("msg"), "", "in_progress")
        else:
            item = reasoning_item(new_item_id("rs"), "", "in_progress")
        self._items.append(item)
        self._open = item
        index = len(self._items) - 1
        self._send("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        self._send("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                   part=_empty_part(item))
        return item

    def _close_open(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        index = self._items.index(item)
        part = item["content"][0]
        done: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
        self._send(_done_event(item["type"]), item_id=item["id"], output_index=index, content_index=0,
                   text=part["text"], **done)
        self._send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                   part=copy.deepcopy(part))
        self._send("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """The recorded response: the items as streamed, the still-open one with its final status."""
        finish = results[0].finish_reason if results else "abort"
        output = copy.deepcopy(self._items)
        for item in output:
            if item["type"] in ("message", "reasoning") and item["status"] == "in_progress":
                item["status"] = item_status(finish)
        messages = [item for item in output if item["type"] == "message"]
        if messages and results and self._top_logprobs is not None:  # every token's, as when not streamed
            result = results[0]
            messages[0]["content"][0]["logprobs"] = logprob_entries(
                self.services.tokenizer, result.output_ids, result.logprobs, result.top_logprobs,
                self._top_logprobs,
            )
        usage_json = usage(self.plan, results, self.services.tokenizer, self._reasoning or None)
        self._final = response_object(self.plan, self.body, output, finish, usage_json)
        return self._final

    def _records(self, results: list[ChoiceResult], response: dict[str, Any]) -> list[CompletionRecord]:
        return completion_records(self.plan, results, request_answered(self.request_json, response), response,
                                  self.conversation)

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        final = self._final if self._final is not None else self._response(results)
        self._close_open(item_status(results[0].finish_reason if results else "abort"))
        self._send("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                   response=final)


def _delta_event(kind: str) -> str:
    return "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"


def _done_event(kind: str) -> str:
    return "response.output_text.done" if kind == "message" else "response.reasoning_text.done"


def _empty_part(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": ""}
