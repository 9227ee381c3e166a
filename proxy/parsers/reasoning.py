"""Reasoning between `<think>` and `</think>` (DeepSeek-R1, Qwen3) goes to `reasoning_content`; the text
after `</think>` is the answer. Reasoning has its surrounding whitespace stripped, the answer its
leading whitespace.

The reasoning is open from the first token when the output starts with `<think>`, when the prompt
already ends with `<think>` (templates that open the block for the model), or always for `deepseek-r1`
(whose template does that). An open block that never closes is all reasoning (the output was cut)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.parsers.base import ContentDelta, ReasoningDelta, TrimmedText, held_prefix_length

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """`proxy.reasoning_parser`; `opens_in_prompt` says the format always starts in reasoning."""

    opens_in_prompt: bool = False

    def starts_in_reasoning(self, prompt_tail: str) -> bool:
        """Whether generation begins inside a reasoning block, given the end of the rendered prompt."""
        return self.opens_in_prompt or prompt_tail.rstrip().endswith(OPEN)

    def parse(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole generated text; reasoning None when there was none."""
        stripped = text.lstrip()
        if stripped.startswith(OPEN):
            text, in_reasoning = stripped[len(OPEN):], True
        if not in_reasoning:
            return None, text
        end = text.find(CLOSE)
        if end < 0:
            return text.strip(), ""
        return text[:end].strip(), text[end + len(CLOSE):].lstrip()

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        return ReasoningStream(in_reasoning)


class ReasoningStream:
    """Incremental `ReasoningParser.parse`."""

    def __init__(self, in_reasoning: bool) -> None:
        self._forced = in_reasoning
        self._state = "start"  # start (a leading <think> may come) | reasoning | content
        self._buffer = ""
        self._reasoning = TrimmedText(strip_start=True)
        self._content = TrimmedText(strip_start=False)

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        self._buffer += text
        events: list[ContentDelta | ReasoningDelta] = []
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(OPEN):
                self._buffer = stripped[len(OPEN):]
                self._state = "reasoning"
            elif OPEN.startswith(stripped):
                return events  # may still become <think>
            else:
                self._state = "reasoning" if self._forced else "content"
        if self._state == "reasoning":
            end = self._buffer.find(CLOSE)
            if end < 0:
                held = held_prefix_length(self._buffer, CLOSE)
                self._add(self._reasoning, ReasoningDelta, self._buffer[:len(self._buffer) - held], events)
                self._buffer = self._buffer[len(self._buffer) - held:]
                return events
            self._add(self._reasoning, ReasoningDelta, self._buffer[:end], events)
            self._buffer = self._buffer[end + len(CLOSE):]
            self._state = "content"
            self._content = TrimmedText(strip_start=True)
        self._add(self._content, ContentDelta, self._buffer, events)
        self._buffer = ""
        return events

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        events: list[ContentDelta | ReasoningDelta] = []
        if self._state == "start":
            self._state = "reasoning" if self._forced else "content"
        if self._state == "reasoning":
            self._add(self._reasoning, ReasoningDelta, self._buffer, events)  # unclosed: all reasoning
        else:
            self._add(self._content, ContentDelta, self._buffer, events)
            if tail := self._content.flush():
                events.append(ContentDelta(tail))
        self._buffer = ""
        return events

    @staticmethod
    def _add(
        trimmed: TrimmedText, kind: type[ContentDelta] | type[ReasoningDelta], text: str,
        events: list[ContentDelta | ReasoningDelta],
    ) -> None:
        if sent := trimmed.add(text):
            events.append(kind(sent))
