"""The completion records of one call: one per choice, each with its place in the session's
conversation (a child keeps only its prompt suffix: docs/architecture.md, "Storage")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.conversations.prompt import ConversationPrompt
from proxy.workers.plan import ChoiceResult, GenerationPlan, recorded_request
from storage.records import CompletionRecord

NO_CONVERSATION = ConversationPrompt([])
"""The place of a call outside any conversation (a raw-prompt completion): a root, never a branch."""


def completion_records(
    plan: GenerationPlan, results: Sequence[ChoiceResult], request_json: dict[str, Any],
    response_json: dict[str, Any], conversation: ConversationPrompt = NO_CONVERSATION, first_index: int = 0,
) -> list[CompletionRecord]:
    """One record per choice. Each stores the response with only its own choice in it; the plan's
    choices are the response's choices `first_index`, `first_index + 1`, … (a batch of prompts)."""
    return [
        CompletionRecord(
            id=plan.completion_ids[result.index],
            session_id=plan.session_id,
            parent_id=conversation.parent_id,
            prompt_ids=plan.prompt_ids[conversation.prefix_len:],
            output_ids=result.output_ids,
            output_logprobs=result.logprobs,
            output_versions=result.versions,
            finish_reason=result.finish_reason,
            temperature=plan.temperature,
            top_p=plan.top_p,
            top_k=plan.top_k,
            request_json=recorded_request(plan, request_json),
            response_json=_own_choice(response_json, first_index + result.index),
            branched=conversation.branched,
            dropped_messages=conversation.dropped,
        )
        for result in results
    ]


def _own_choice(response_json: dict[str, Any], index: int) -> dict[str, Any]:
    if len(response_json.get("choices", ())) <= 1:  # a Responses API object has no choices
        return response_json
    own = [choice for choice in response_json["choices"] if choice["index"] == index]
    return {**response_json, "choices": own}
