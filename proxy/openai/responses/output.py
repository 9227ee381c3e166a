"""Response objects of the Responses API: output items (reasoning, message, and each tool call as the
item its tool's kind answers with: responses/tools.py) of a parsed generation, usage, and the `response`
object with the request parameters the client types require."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from proxy.openai.chat_objects import logprob_entries, tool_call_id
from proxy.openai.responses.input import ResponsesRequest
from proxy.openai.responses.tools import ToolRef, custom_input, shell_action, tool_refs
from proxy.parsers import ParsedOutput, ParsedToolCall
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, GenerationPlan

RESPONSE_PREFIX = "resp_"


def new_item_id(prefix: str) -> str:
    """`msg_…`, `fc_…`, `rs_…`: ids of output items."""
    return f"{prefix}_{secrets.token_hex(12)}"


def new_response_id() -> str:
    """The response's id, which is also the id of its recorded completion."""
    return new_item_id(RESPONSE_PREFIX.rstrip("_"))


def item_status(finish_reason: str) -> str:
    return "completed" if finish_reason == "stop" else "incomplete"


def response_status(finish_reason: str) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details) of a response whose generation ended with `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: ParsedToolCall, refs: dict[str, ToolRef]) -> dict[str, Any]:
    """The output item of a parsed tool call, by what its name stands for: a `function_call` (with the
    function's own name), a `custom_tool_call` (its input), each with its tool's `namespace` when it has
    one, or a `local_shell_call`. A name no tool has (the model is not constrained), or a local shell call
    naming no command, is a plain function call."""
    ref = refs.get(call.name)
    action = shell_action(call.arguments) if ref is not None and ref.kind == "local_shell" else None
    if action is not None:
        return {"id": new_item_id("lsh"), "type": "local_shell_call", "call_id": tool_call_id(),
                "action": action, "status": "completed"}
    item: dict[str, Any]
    if ref is not None and ref.kind == "custom":
        item = {"id": new_item_id("ctc"), "type": "custom_tool_call", "call_id": tool_call_id(),
                "name": ref.name, "input": custom_input(call.arguments), "status": "completed"}
    else:
        item = {"id": new_item_id("fc"), "type": "function_call", "call_id": tool_call_id(),
                "name": call.name if ref is None else ref.name, "arguments": call.arguments,
                "status": "completed"}
    if ref is not None and ref.namespace is not None:
        item["namespace"] = ref.namespace
    return item


def output_items(
    parsed: ParsedOutput, finish_reason: str, refs: dict[str, ToolRef],
    logprobs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The output of a non-streaming response: reasoning, then the message, then the tool calls, in the
    order the model wrote them (a Hermes model writes text before its calls)."""
    status = item_status(finish_reason)
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(new_item_id("rs"), parsed.reasoning, status))
    if parsed.content:
        items.append(message_item(new_item_id("msg"), parsed.content, status, logprobs))
    items.extend(call_item(call, refs) for call in parsed.tool_calls)
    return items


def usage(
    plan: GenerationPlan, results: Sequence[ChoiceResult], tokenizer: ChatTokenizer, reasoning: str | None
) -> dict[str, Any]:
    """Token counts; reasoning tokens are those of the reasoning text re-encoded (the worker does not
    say where reasoning ended), so they are exact only up to tokenisation at the boundary."""
    output_tokens = sum(len(result.output_ids) for result in results)
    reasoning_tokens = min(len(tokenizer.encode(reasoning)), output_tokens) if reasoning else 0
    return {
        "input_tokens": len(plan.prompt_ids),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": len(plan.prompt_ids) + output_tokens,
    }


def response_object(
    plan: GenerationPlan, body: ResponsesRequest, output: list[dict[str, Any]], finish_reason: str | None,
    usage_json: dict[str, Any] | None,
) -> dict[str, Any]:
    """The `response` object; `finish_reason` None while it is still being generated (a stream's
    `response.created`)."""
    status, incomplete = ("in_progress", None) if finish_reason is None else response_status(finish_reason)
    return {
        "id": plan.response_id,
        "object": "response",
        "created_at": plan.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "model": plan.model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning or {"effort": None, "summary": None},
        "service_tier": "default",
        "store": body.stored,
        "temperature": plan.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": plan.top_p,
        "truncation": body.truncation or "disabled",
        "usage": usage_json,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def complete_response(
    plan: GenerationPlan, body: ResponsesRequest, result: ChoiceResult, tokenizer: ChatTokenizer,
    wants_logprobs: bool,
) -> dict[str, Any]:
    """The response of a non-streaming generation."""
    parsed = plan.output.parse(result.text)
    logprobs = None
    if wants_logprobs:
        logprobs = logprob_entries(tokenizer, result.output_ids, result.logprobs, result.top_logprobs,
                                   body.top_logprobs or 0)
    output = output_items(parsed, result.finish_reason, tool_refs(body.tools), logprobs)
    return response_object(plan, body, output, result.finish_reason,
                           usage(plan, [result], tokenizer, parsed.reasoning))
