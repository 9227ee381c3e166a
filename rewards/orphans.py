"""Retry orphans (pure, no I/O). Agent SDKs retry a call that timed out; the proxy still answers and
records the first attempt, so one turn has two completions, and the conversation goes on from only one
of them (the answer the client received). The other is a retry orphan: the agent never saw its output,
so nothing it was rewarded for followed from it.

A completion is a retry orphan when
- a sibling from another call has the same parent (both None: two roots of one session) and the same
  new input (`turn_key`),
- that sibling was continued (another completion has it as its parent),
- and no completion of its own call was (an `n > 1` call records its choices as completions of one
  call: a choice the agent did not continue from is a sample it was offered, not an orphan).
Two identical calls of which neither was continued are not orphans: that is deliberate resampling.

`turn_key` compares new messages by the keys the proxy's prefix matching compares (rewards/message_keys.py
`message_key`): role, content text and tool calls by function name and canonical JSON arguments,
ignoring what clients rewrite or drop on a retry (tool-call ids, `tool_call_id`, `name`,
`reasoning_content`, the whitespace around an answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rewards.message_keys import canonical_json, message_key
from storage.records import CompletionRecord

CHAT_VIEW = "chat_view"  # a Responses call's record: the chat messages it added (proxy/conversations/tree.py)


def _message(message: Any) -> Any:
    return list(message_key(message)) if isinstance(message, Mapping) else canonical_json(message)


def turn_key(request_json: Mapping[str, Any]) -> str:
    """What a recorded call added to its parent's conversation, as canonical text: its new chat messages
    and tools (a Responses call's from its chat view), or a raw-prompt call's prompt."""
    view = request_json.get(CHAT_VIEW)
    source = view if isinstance(view, Mapping) else request_json
    messages = source.get("messages")
    if isinstance(messages, list):
        return canonical_json([[_message(m) for m in messages], source.get("tools") or None])
    return canonical_json(["prompt", request_json.get("prompt")])


def _call_of(completion: CompletionRecord) -> str:
    """The call a completion was one choice of: its response's id (every choice of a call, every prompt
    of a legacy batch, shares it)."""
    response_id = completion.response_json.get("id")
    return response_id if isinstance(response_id, str) else completion.id


def retry_orphans(completions: Sequence[CompletionRecord]) -> dict[str, str]:
    """`{orphan id: kept id}` over one session's completions (in call order): each retry orphan and the
    continued sibling the conversation went on from instead (the first, in call order, when several were)."""
    continued = {c.parent_id for c in completions if c.parent_id is not None}
    turns: dict[tuple[str | None, str], list[CompletionRecord]] = {}
    for completion in completions:
        turns.setdefault((completion.parent_id, turn_key(completion.request_json)), []).append(completion)
    orphans: dict[str, str] = {}
    for siblings in turns.values():
        if len(siblings) < 2:
            continue
        kept = next((c for c in siblings if c.id in continued), None)
        if kept is None:
            continue  # resampled, never continued: no orphans
        calls: dict[str, list[CompletionRecord]] = {}
        for completion in siblings:
            calls.setdefault(_call_of(completion), []).append(completion)
        for choices in calls.values():
            if not any(c.id in continued for c in choices):
                orphans.update((c.id, kept.id) for c in choices)
    return orphans
