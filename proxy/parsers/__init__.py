"""Parsers that turn generated text into OpenAI's structured view (tool calls, reasoning), chosen by
config like SGLang's `--tool-call-parser` and `--reasoning-parser`. They change only the response JSON:
the recorded completion keeps the exact tokens the worker generated. Beside them, the grammars that
make a worker write JSON or a forced tool call in the parser's format (`constraints.py`)."""

from __future__ import annotations

from proxy.parsers.base import (
    ContentDelta,
    ParsedToolCall,
    ReasoningDelta,
    StreamEvent,
    ToolCallDelta,
    ToolCallParser,
)
from proxy.parsers.constraints import (
    ANY_OBJECT_SCHEMA,
    Constraint,
    ConstraintError,
    FunctionSpec,
    check_schema,
    json_constraint,
)
from proxy.parsers.hermes import HermesParser, NoToolParser
from proxy.parsers.output import OutputParser, OutputStream, ParsedOutput
from proxy.parsers.reasoning import ReasoningParser

TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "none": NoToolParser()}
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek-r1": ReasoningParser(opens_in_prompt=True),
    "qwen3": ReasoningParser(opens_in_prompt=False),
}


def tool_call_parser(name: str) -> ToolCallParser:
    """The registered tool-call parser `name`; ValueError naming the valid ones otherwise."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; valid: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[name]


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The registered reasoning parser `name` (None: none); ValueError naming the valid ones otherwise."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning_parser {name!r}; valid: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


__all__ = [
    "ANY_OBJECT_SCHEMA", "REASONING_PARSERS", "TOOL_CALL_PARSERS", "Constraint", "ConstraintError",
    "ContentDelta", "FunctionSpec", "OutputParser", "OutputStream", "ParsedOutput", "ParsedToolCall",
    "ReasoningDelta", "ReasoningParser", "StreamEvent", "ToolCallDelta", "ToolCallParser", "check_schema",
    "json_constraint", "reasoning_parser", "tool_call_parser",
]
