"""A stored session as a hook sees it (pure): each completion's whole prompt as messages and token ids, its
answer as a message and as text, and its users' feedback.

A completion with a parent stores only what it added (its new messages, its prompt's token suffix), so the
whole prompt is rebuilt through the chain: the parent's prompt, the parent's answer, then its own part.
Chat calls store their messages; Responses API calls store a `chat_view` of theirs; a legacy completion's
prompt (one string) becomes one user message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rewards.finalize import full_prompts, is_trainable
from rewards.hooks.contract import CompletionView, FeedbackView, GroupInput, SessionInput
from rewards.snapshot import SessionSnapshot
from storage.feedback import StoredFeedback
from storage.records import CompletionRecord

CHAT_VIEW = "chat_view"  # what a Responses API call records beside its request (its messages as chat)


def new_messages(record: CompletionRecord) -> list[dict[str, Any]]:
    """The messages this completion's request added to its parent's conversation."""
    request = record.request_json
    view = request.get(CHAT_VIEW)
    if isinstance(view, Mapping):
        return [dict(message) for message in view.get("messages") or ()]
    if isinstance(request.get("messages"), list):
        return [dict(message) for message in request["messages"]]
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []


def answer_message(record: CompletionRecord) -> dict[str, Any]:
    """The assistant message the completion generated."""
    view = record.request_json.get(CHAT_VIEW)
    if isinstance(view, Mapping) and isinstance(view.get("answer"), Mapping):
        return dict(view["answer"])
    choices = record.response_json.get("choices") or []
    if choices and isinstance(choices[0], Mapping):
        choice = choices[0]
        if isinstance(choice.get("message"), Mapping):
            return dict(choice["message"])
        if isinstance(choice.get("text"), str):
            return {"role": "assistant", "content": choice["text"]}
    return {"role": "assistant", "content": ""}


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, Mapping)
        )
    return ""


def completion_views(completions: Sequence[CompletionRecord]) -> tuple[CompletionView, ...]:
    """The session's completions (in call order) as hooks see them."""
    prompts = full_prompts(completions)
    by_id = {record.id: record for record in completions}
    messages: dict[str, tuple[dict[str, Any], ...]] = {}
    answers: dict[str, dict[str, Any]] = {}
    views: list[CompletionView] = []
    for record in completions:  # call order: a parent always comes before its children
        inherited: tuple[dict[str, Any], ...] = ()
        if record.parent_id is not None and record.parent_id in by_id:
            inherited = (*messages[record.parent_id], answers[record.parent_id])
        messages[record.id] = (*inherited, *new_messages(record))
        answers[record.id] = answer_message(record)
        views.append(CompletionView(
            id=record.id,
            parent_id=record.parent_id,
            messages=messages[record.id],
            message=answers[record.id],
            text=message_text(answers[record.id]),
            prompt_ids=tuple(int(token) for token in prompts[record.id]),
            output_ids=tuple(int(token) for token in record.output_ids),
            finish_reason=record.finish_reason,
            trainable=is_trainable(record),
        ))
    return tuple(views)


def feedback_views(feedback: Sequence[StoredFeedback]) -> tuple[FeedbackView, ...]:
    """The session's feedback (in arrival order) as hooks see it."""
    return tuple(
        FeedbackView(completion_id=f.completion_id, value=f.value, thumbs=f.thumbs, comment=f.comment)
        for f in feedback
    )


def session_input(snapshot: SessionSnapshot) -> SessionInput:
    return SessionInput(
        session_id=snapshot.id,
        group_id=snapshot.group_id,
        task=snapshot.task,
        metadata=dict(snapshot.metadata),
        completions=completion_views(snapshot.completions),
        feedback=feedback_views(snapshot.feedback),
    )


def group_input(group_id: str, task: Any, snapshots: Sequence[SessionSnapshot]) -> GroupInput:
    return GroupInput(group_id=group_id, task=task, sessions=tuple(session_input(s) for s in snapshots))
