"""One choice's generated text through the configured parsers: reasoning first, then tool calls in what
remains. `parse` for a whole text; `stream` for text deltas, yielding the same result in any chunking."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.parsers.base import (
    ContentDelta,
    ParsedToolCall,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
)
from proxy.parsers.constraints import Constraint
from proxy.parsers.reasoning import ReasoningParser, ReasoningStream


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    reasoning: str | None
    tool_calls: list[ParsedToolCall]


@dataclass(frozen=True, slots=True)
class OutputParser:
    """The parsing one request gets. `tools` None: tool calls are not parsed (no tools offered, or
    `tool_choice: none`); `max_tool_calls` 1 when the request set `parallel_tool_calls: false`;
    `constraint` the grammar the worker enforces on the output (JSON, forced tool calls), if any."""

    tools: ToolCallParser | None
    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False
    max_tool_calls: int | None = None
    constraint: Constraint | None = None

    def parse(self, text: str) -> ParsedOutput:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text, self.in_reasoning)
        if self.tools is None:
            return ParsedOutput(text, reasoning, [])
        content, calls = self.tools.parse(text)
        return ParsedOutput(content, reasoning, calls[:self.max_tool_calls])

    def stream(self) -> OutputStream:
        return OutputStream(self)


class OutputStream:
    """Incremental `OutputParser.parse` for one choice: feed text deltas, then finish once."""

    def __init__(self, parser: OutputParser) -> None:
        self._reasoning: ReasoningStream | None = (
            parser.reasoning.stream(parser.in_reasoning) if parser.reasoning is not None else None
        )
        self._tools: ToolCallStream | None = parser.tools.stream() if parser.tools is not None else None
        self._max_tool_calls = parser.max_tool_calls

    def feed(self, text: str) -> list[StreamEvent]:
        if self._reasoning is None:
            return self._through_tools([ContentDelta(text)] if text else [], final=False)
        return self._through_tools(self._reasoning.feed(text), final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._reasoning.finish() if self._reasoning is not None else []
        return self._through_tools(events, final=True)

    def _through_tools(self, events: list[ContentDelta | ReasoningDelta], final: bool) -> list[StreamEvent]:
        if self._tools is None:
            return list(events)
        out: list[StreamEvent] = []
        for event in events:
            out.extend(self._tools.feed(event.text) if isinstance(event, ContentDelta) else [event])
        if final:
            out.extend(self._tools.finish())
        return [e for e in out if not isinstance(e, ToolCallDelta) or self._allowed(e.index)]

    def _allowed(self, index: int) -> bool:
        return self._max_tool_calls is None or index < self._max_tool_calls
