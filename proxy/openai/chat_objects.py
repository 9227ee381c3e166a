"""OpenAI's chat response objects: chat.completion, its chunks, logprobs (which the Responses API's
messages carry too), usage."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.openai.schemas import ChatCompletionRequest
from proxy.parsers import ParsedOutput, ParsedToolCall
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, GenerationPlan

CHUNK_OBJECT = "chat.completion.chunk"


def logprob_entries(
    tokenizer: ChatTokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
    top_logprobs: Sequence[Sequence[tuple[float, int]]] | None, top_n: int,
) -> list[dict[str, Any]]:
    """`choices[].logprobs.content`: {token, logprob, bytes, top_logprobs} per output token."""
    entries = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        alternatives: list[dict[str, Any]] = []
        if top_logprobs is not None and top_n > 0 and position < len(top_logprobs):
            alternatives = [_token_logprob(tokenizer, tid, lp) for lp, tid in top_logprobs[position][:top_n]]
        entry = _token_logprob(tokenizer, token_id, logprob)
        entry["top_logprobs"] = alternatives
        entries.append(entry)
    return entries


def _token_logprob(tokenizer: ChatTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def usage(prompt_tokens: int, results: Sequence[ChoiceResult]) -> dict[str, int]:
    completion_tokens = sum(len(result.output_ids) for result in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def finish_reason(worker_reason: str, has_tool_calls: bool) -> str:
    """OpenAI's finish_reason: a generation that stopped after calling tools says `tool_calls`."""
    return "tool_calls" if has_tool_calls and worker_reason == "stop" else worker_reason


def tool_call_json(call_id: str, call: ParsedToolCall) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(parsed: ParsedOutput, call_ids: Sequence[str]) -> dict[str, Any]:
    """The assistant message of a parsed choice; `call_ids` are used first (ids a stream already sent),
    new ones after them. Content is null when the model only called tools."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        calls = parsed.tool_calls
        ids = [*call_ids[:len(calls)], *(tool_call_id() for _ in calls[len(call_ids):])]
        message["tool_calls"] = [tool_call_json(i, call) for i, call in zip(ids, calls, strict=True)]
    return message


def chat_choice(
    plan: GenerationPlan, result: ChoiceResult, body: ChatCompletionRequest, tokenizer: ChatTokenizer,
    call_ids: Sequence[str] = (),
) -> dict[str, Any]:
    parsed = plan.output.parse(result.text)
    choice: dict[str, Any] = {
        "index": result.index,
        "message": chat_message(parsed, call_ids),
        "logprobs": None,
        "finish_reason": finish_reason(result.finish_reason, bool(parsed.tool_calls)),
    }
    if body.wants_logprobs:
        content = logprob_entries(
            tokenizer, result.output_ids, result.logprobs, result.top_logprobs, body.top_logprobs or 0
        )
        choice["logprobs"] = {"content": content, "refusal": None}
    if plan.n > 1:
        choice["completion_id"] = plan.completion_ids[result.index]
    if body.return_token_ids:
        choice["token_ids"] = result.output_ids
    return choice


def chat_completion(
    plan: GenerationPlan, results: Sequence[ChoiceResult], body: ChatCompletionRequest,
    tokenizer: ChatTokenizer, call_ids: Mapping[int, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """The `chat.completion` object of a non-streaming answer (and the record of a streamed one, whose
    `call_ids` per choice index are the tool-call ids the stream sent)."""
    call_ids = call_ids or {}
    response: dict[str, Any] = {
        "id": plan.response_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "choices": [chat_choice(plan, result, body, tokenizer, call_ids.get(result.index, ()))
                    for result in results],
        "usage": usage(len(plan.prompt_ids), results),
        "system_fingerprint": None,
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = plan.prompt_ids
    return response


def chunk(plan: GenerationPlan, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
    """One `chat.completion.chunk`; with include_usage every chunk but the last carries `usage: null`."""
    payload: dict[str, Any] = {
        "id": plan.response_id,
        "object": CHUNK_OBJECT,
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": None,
        "choices": choices,
    }
    if include_usage:
        payload["usage"] = None
    return payload
