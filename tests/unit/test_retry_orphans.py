"""Retry orphans (rewards/orphans.py): of two calls asking the same thing after the same parent, the one
the conversation did not go on from while the other's was, and nothing else."""

from __future__ import annotations

import dataclasses
from typing import Any

from rewards.orphans import retry_orphans, turn_key
from storage.records import CompletionRecord
from tests.support.completion_records import completion

ASK = [{"role": "user", "content": "More."}]


def call(
    cid: str,
    parent: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    response: str | None = None,
) -> CompletionRecord:
    """A chat completion `cid` with these new messages, one choice of the call `response` (else its own)."""
    return dataclasses.replace(
        completion(cid, [1, 2], [3, 4], parent=parent),
        request_json={"model": "m", "messages": messages if messages is not None else ASK},
        response_json={"id": response or cid, "choices": []},
    )


def test_the_attempt_nobody_continued_is_an_orphan_of_the_retry_that_was() -> None:
    root = call("root", messages=[{"role": "user", "content": "Plan a trip."}])
    timed_out, retried = call("first", "root"), call("retry", "root")
    went_on = call("next", "retry", [{"role": "user", "content": "Thanks."}])
    assert retry_orphans([root, timed_out, retried, went_on]) == {"first": "retry"}
    # Recorded in any order (the timed-out attempt often lands last): the same verdict.
    assert retry_orphans([root, retried, went_on, timed_out]) == {"first": "retry"}


def test_roots_of_one_session_are_siblings_too() -> None:
    first, retry = call("a", messages=ASK), call("b", messages=ASK)
    assert retry_orphans([first, retry, call("c", "a")]) == {"b": "a"}


def test_resamples_that_nobody_continued_are_not_orphans() -> None:
    assert retry_orphans([call("root"), call("x", "root"), call("y", "root")]) == {}


def test_other_parents_or_other_messages_are_not_siblings() -> None:
    other_question = call("q", "root", [{"role": "user", "content": "Less."}])
    other_parent = call("p", "elsewhere")
    completions = [
        call("root"),
        call("elsewhere"),
        call("kept", "root"),
        call("next", "kept"),
        other_question,
        other_parent,
    ]
    assert retry_orphans(completions) == {}


def test_choices_of_one_call_are_samples_not_orphans() -> None:
    """An n = 2 call offers two choices: the one not taken is no orphan; when the call itself was
    retried, both its choices are."""
    offered = [call("c0", "root", response="c0"), call("c0-1", "root", response="c0")]
    assert retry_orphans([call("root"), *offered, call("next", "c0")]) == {}
    retried = [call("r0", "root", response="r0"), call("r0-1", "root", response="r0")]
    found = retry_orphans([call("root"), *offered, *retried, call("next", "r0")])
    assert found == {"c0": "r0", "c0-1": "r0"}


def test_messages_compare_as_prefix_matching_does_ignoring_ids_and_spacing() -> None:
    """A retry re-sends the turn, but tool-call ids, names and argument spacing may change."""
    sent = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    resent = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"b":2,"a":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "name": "add", "content": [{"type": "text", "text": "3"}]},
    ]
    assert turn_key({"messages": sent}) == turn_key({"messages": resent})
    assert turn_key({"messages": sent}) != turn_key({"messages": sent[:1]})
    assert turn_key({"messages": sent, "tools": [{"type": "function"}]}) != turn_key({"messages": sent})


def test_responses_calls_compare_by_their_chat_view_and_raw_prompts_by_prompt() -> None:
    view = {"chat_view": {"messages": ASK, "tools": None, "answer": None}, "input": "More.", "store": False}
    assert turn_key(view) == turn_key({"messages": ASK, "model": "other"})
    assert turn_key({"prompt": "Once"}) == turn_key({"prompt": "Once", "max_tokens": 4})
    assert turn_key({"prompt": "Once"}) != turn_key({"prompt": [5, 6]})
