"""OpenAI response objects (chat.completion, chunks, logprobs, usage) and the completion records the
proxy writes for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.generation import ChoiceResult, GenerationPlan
from proxy.schemas import ChatCompletionRequest
from proxy.tokenize import ChatTokenizer
from storage.records import CompletionRecord

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


def chat_choice(
    plan: GenerationPlan, result: ChoiceResult, body: ChatCompletionRequest, tokenizer: ChatTokenizer
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": result.index,
        "message": {"role": "assistant", "content": result.text, "refusal": None},
        "logprobs": None,
        "finish_reason": result.finish_reason,
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
    tokenizer: ChatTokenizer,
) -> dict[str, Any]:
    """The `chat.completion` object of a non-streaming answer."""
    response: dict[str, Any] = {
        "id": plan.response_id,
        "object": "chat.completion",
        "created": plan.created,
        "model": plan.model,
        "choices": [chat_choice(plan, result, body, tokenizer) for result in results],
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


def completion_records(
    plan: GenerationPlan, results: Sequence[ChoiceResult], request_json: dict[str, Any],
    response_json: dict[str, Any],
) -> list[CompletionRecord]:
    """One record per choice. Each stores the response with only its own choice in it."""
    return [
        CompletionRecord(
            id=plan.completion_ids[result.index],
            session_id=plan.session_id,
            parent_id=None,
            prompt_ids=plan.prompt_ids,
            output_ids=result.output_ids,
            output_logprobs=result.logprobs,
            output_versions=result.versions,
            finish_reason=result.finish_reason,
            temperature=plan.temperature,
            top_p=plan.top_p,
            top_k=plan.top_k,
            request_json=request_json,
            response_json=_own_choice(response_json, result.index, plan.n),
        )
        for result in results
    ]


def _own_choice(response_json: dict[str, Any], index: int, n: int) -> dict[str, Any]:
    if n == 1:
        return response_json
    own = [choice for choice in response_json["choices"] if choice["index"] == index]
    return {**response_json, "choices": own}
