"""Hook inputs as JSON: what a hook that calls out (a webhook, a judge) sends about a session or a group.

Pure functions from the contract's `SessionInput` / `GroupInput` to plain dicts and lists that `json.dumps`
accepts (tuples become lists, mappings dicts), with the same field names as the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rewards.hooks.contract import CompletionView, GroupInput, SessionInput


def _plain(value: Any) -> Any:
    """`value` with every mapping made a dict and every tuple or list a list, recursively."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def completion_json(completion: CompletionView) -> dict[str, Any]:
    """One completion: its ids, prompt and answer as messages and as text, its token ids, how it ended,
    and whether it is trained on."""
    return {
        "id": completion.id,
        "parent_id": completion.parent_id,
        "messages": _plain(completion.messages),
        "message": _plain(completion.message),
        "text": completion.text,
        "prompt_ids": list(completion.prompt_ids),
        "output_ids": list(completion.output_ids),
        "finish_reason": completion.finish_reason,
        "trainable": completion.trainable,
    }


def session_json(subject: SessionInput) -> dict[str, Any]:
    """A finished session: its ids, the task and metadata the agent attached, and its completions in call
    order."""
    return {
        "session_id": subject.session_id,
        "group_id": subject.group_id,
        "task": _plain(subject.task),
        "metadata": _plain(subject.metadata),
        "completions": [completion_json(completion) for completion in subject.completions],
    }


def group_json(subject: GroupInput) -> dict[str, Any]:
    """A finished group: its id, its task, and each of its sessions as `session_json` writes it."""
    return {
        "group_id": subject.group_id,
        "task": _plain(subject.task),
        "sessions": [session_json(session) for session in subject.sessions],
    }
