"""The `message` object of the Messages API: content blocks (thinking, text, tool_use) of a parsed
generation, its stop reason and stop sequence, and usage."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from proxy.parsers import ParsedOutput, ParsedToolCall
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, GenerationPlan

MESSAGE_PREFIX = "msg_"
TOOL_USE_PREFIX = "toolu_"


def new_message_id() -> str:
    """The message's id, which is also the id of its recorded completion."""
    return f"{MESSAGE_PREFIX}{secrets.token_hex(12)}"


def new_tool_use_id() -> str:
    return f"{TOOL_USE_PREFIX}{secrets.token_hex(12)}"


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    """Reasoning the parser split out; it has no signature (no one can verify one from this server)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(block_id: str, call: ParsedToolCall) -> dict[str, Any]:
    arguments = json.loads(call.arguments)  # the parsers write a JSON object
    return {"type": "tool_use", "id": block_id, "name": call.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def content_blocks(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """The blocks of a whole generation: its reasoning, its text, then its tool calls."""
    blocks = [thinking_block(parsed.reasoning)] if parsed.reasoning else []
    if parsed.content:
        blocks.append(text_block(parsed.content))
    return blocks + [tool_use_block(new_tool_use_id(), call) for call in parsed.tool_calls]


def matched_stop(result: ChoiceResult, stop_sequences: Sequence[str], tokenizer: ChatTokenizer) -> str | None:
    """The stop sequence that ended the generation, if one did. The worker cuts a matched stop string
    from its text but keeps the tokens that spelled it: it is in what they spell past the text."""
    if result.finish_reason != "stop" or not stop_sequences:
        return None
    spelled = tokenizer.decode(result.output_ids)
    tail = spelled[len(result.text):] if spelled.startswith(result.text) else spelled
    found = [(tail.find(stop), stop) for stop in stop_sequences if stop in tail]
    return min(found)[1] if found else None


def stop_reason(finish_reason: str, called_tools: bool, stop_sequence: str | None) -> str:
    """`max_tokens` when cut by the budget, `tool_use` after tool calls, `stop_sequence` when one
    matched, else `end_turn` (an aborted generation included: it ended without the model's say)."""
    if finish_reason == "length":
        return "max_tokens"
    if called_tools:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage(plan: GenerationPlan, results: Sequence[ChoiceResult]) -> dict[str, int]:
    """Token counts; nothing is cached by Anthropic's prompt caching here, so its counts are 0."""
    return {
        "input_tokens": len(plan.prompt_ids),
        "output_tokens": sum(len(result.output_ids) for result in results),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_object(
    plan: GenerationPlan, content: list[dict[str, Any]], reason: str | None, stop_sequence: str | None,
    usage_json: dict[str, int],
) -> dict[str, Any]:
    """The `message` object; `reason` None while it is still being generated (a stream's start)."""
    return {
        "id": plan.response_id,
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": usage_json,
    }


def complete_message(
    plan: GenerationPlan, result: ChoiceResult, tokenizer: ChatTokenizer, stop_sequences: Sequence[str]
) -> dict[str, Any]:
    """The message of a non-streaming generation."""
    content = content_blocks(plan.output.parse(result.text))
    stop = matched_stop(result, stop_sequences, tokenizer)
    called = any(block["type"] == "tool_use" for block in content)
    return message_object(plan, content, stop_reason(result.finish_reason, called, stop), stop,
                          usage(plan, [result]))
