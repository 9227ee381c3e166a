"""Hermes/Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per
call (several blocks are parallel calls). A block whose JSON is not a call stays content, as does an
unterminated block.

Content is the text as the model wrote it minus the call blocks, with two rules where a block was cut:
whitespace between a block and the start or end of the content is dropped (it only separated text from
markup, and chat templates put it back when the message is rendered again), and text on both sides of a
block keeps the whitespace it had there, or one space where it had none (so words never merge)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from proxy.parsers.base import ContentDelta, ParsedToolCall, ToolCallDelta, held_prefix_length
from proxy.parsers.constraints import CallFormat, Constraint, ConstraintError, FunctionSpec

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_FORMAT = CallFormat(opening=OPEN + '\n{"name": "{name}", "arguments": ', closing="}\n" + CLOSE,
                         separator="\n")
"""Calls as Qwen's chat template writes them, for the grammar of a forced call."""


def read_call(inner: str) -> ParsedToolCall | None:
    """The call in one block's text, or None if it is not `{"name": str, "arguments": object}`."""
    try:
        payload = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(payload["name"], json.dumps(arguments, ensure_ascii=False))


class CutText:
    """The content rule of the module docstring, applied incrementally: `add` text outside call blocks,
    `cut` where a block was, `finish` once. Whitespace waits until the next text or the end shows which
    rule applies to it, so any chunking of the same text gives the same content."""

    def __init__(self) -> None:
        self._pending = ""  # whitespace not sent yet
        self._said = False  # some non-whitespace text was sent
        self._cut = False  # a block was cut since the last non-whitespace text

    def add(self, text: str) -> str:
        body = text.lstrip()
        self._pending += text[:len(text) - len(body)]
        if not body:
            return ""
        kept = body.rstrip()
        if self._said:
            lead = self._pending or (" " if self._cut else "")
        else:  # the content's start: whitespace before a cut block is dropped
            lead = "" if self._cut else self._pending
        self._pending = body[len(kept):]
        self._said, self._cut = True, False
        return lead + kept

    def cut(self) -> None:
        self._cut = True

    def finish(self) -> str:
        """The text ends: trailing whitespace stays unless a block came after the last text."""
        pending, self._pending = self._pending, ""
        return "" if self._cut else pending


class HermesParser:
    """`proxy.tool_call_parser: hermes`."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls: list[ParsedToolCall] = []
        content = CutText()
        pieces: list[str] = []
        piece_start = 0
        search = 0
        while (start := text.find(OPEN, search)) >= 0:
            end = text.find(CLOSE, start + len(OPEN))
            if end < 0:
                break  # unterminated: content
            search = end + len(CLOSE)
            call = read_call(text[start + len(OPEN):end])
            if call is None:
                continue  # malformed: the block stays in the current piece of content
            pieces.append(content.add(text[piece_start:start]))
            content.cut()
            calls.append(call)
            piece_start = search
        if not calls:
            return text, []
        pieces.append(content.add(text[piece_start:]))
        pieces.append(content.finish())
        return "".join(pieces) or None, calls

    def stream(self) -> HermesStream:
        return HermesStream()

    def forced_calls(self, functions: Sequence[FunctionSpec], *, several: bool) -> Constraint:
        return CALL_FORMAT.grammar(functions, several=several)


class HermesStream:
    """Incremental `HermesParser.parse`: never sends text that may still turn out to be call markup."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_block = False
        self._calls = 0
        self._content = CutText()

    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        self._buffer += text
        events: list[ContentDelta | ToolCallDelta] = []
        while True:
            if not self._in_block:
                start = self._buffer.find(OPEN)
                if start < 0:
                    held = held_prefix_length(self._buffer, OPEN)
                    self._add_content(self._buffer[:len(self._buffer) - held], events)
                    self._buffer = self._buffer[len(self._buffer) - held:]
                    return events
                self._add_content(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_block = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                return events
            inner = self._buffer[:end]
            self._buffer = self._buffer[end + len(CLOSE):]
            self._in_block = False
            call = read_call(inner)
            if call is None:
                self._add_content(OPEN + inner + CLOSE, events)
                continue
            self._content.cut()
            events.append(ToolCallDelta(self._calls, call))
            self._calls += 1

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        events: list[ContentDelta | ToolCallDelta] = []
        self._add_content((OPEN if self._in_block else "") + self._buffer, events)
        self._buffer, self._in_block = "", False
        if tail := self._content.finish():
            events.append(ContentDelta(tail))
        return events

    def _add_content(self, text: str, events: list[ContentDelta | ToolCallDelta]) -> None:
        if sent := self._content.add(text):
            events.append(ContentDelta(sent))


class NoToolParser:
    """`proxy.tool_call_parser: none`: all text is content."""

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        return text, []

    def stream(self) -> PassThroughStream:
        return PassThroughStream()

    def forced_calls(self, functions: Sequence[FunctionSpec], *, several: bool) -> Constraint:
        raise ConstraintError("A forced tool call (tool_choice 'required' or a named function) needs a "
                              "tool-call format; this server parses none (proxy.tool_call_parser).",
                              "tool_choice")


class PassThroughStream:
    def feed(self, text: str) -> list[ContentDelta | ToolCallDelta]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[ContentDelta | ToolCallDelta]:
        return []
