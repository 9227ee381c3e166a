"""What output parsers emit, and the text helpers they share (held-back tag prefixes, whitespace that
only becomes content once something else follows it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.parsers.constraints import Constraint, FunctionSpec


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One tool call read from generated text; `arguments` is a JSON object as a string."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A whole tool call, ready to stream (the parser emits a call once its closing tag arrived, so a
    block that turns out malformed can still become content)."""

    index: int
    call: ParsedToolCall


StreamEvent = ContentDelta | ReasoningDelta | ToolCallDelta


class ToolCallStream(Protocol):
    """Incremental tool-call parsing of one choice: feed text deltas, then finish once."""

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]: ...

    def finish(self) -> list[ContentDelta | ToolCallDelta]: ...


class ToolCallParser(Protocol):
    """A tool-call format (`proxy.tool_call_parser`)."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole generated text. Content is None only when calls were found and
        nothing else was said."""
        ...

    def stream(self) -> ToolCallStream: ...

    def forced_calls(self, functions: Sequence[FunctionSpec], *, several: bool) -> Constraint:
        """The grammar of output that is only calls in this format: one call (`several`: one or more)
        of any of `functions`, with arguments matching its parameters; ConstraintError if this format
        cannot be forced."""
        ...


def held_prefix_length(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may yet become it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class TrimmedText:
    """Streams text with whitespace removed where a non-streaming parse strips it: optionally at the
    start, and at the end of each piece that a tag closes. Trailing whitespace waits until more text
    shows whether it is inside the piece or at its end."""

    def __init__(self, strip_start: bool) -> None:
        self.strip_start = strip_start
        self.pending = ""

    def add(self, text: str) -> str:
        if self.strip_start:
            text = text.lstrip()
            if not text:
                return ""
            self.strip_start = False
        combined = self.pending + text
        kept = combined.rstrip()
        self.pending = combined[len(kept):]
        return kept

    def cut(self, strip_next_start: bool) -> None:
        """The piece ends at a tag: drop its trailing whitespace."""
        self.pending = ""
        self.strip_start = strip_next_start

    def flush(self) -> str:
        """The text ends here: trailing whitespace is kept."""
        pending, self.pending = self.pending, ""
        return pending
