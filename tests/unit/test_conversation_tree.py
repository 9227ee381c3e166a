"""proxy/conversations/tree.py: a session's tree of recorded chat completions, the deepest one a new
call extends, when a reload from the database is called for, its bounds, and the keys a chat call hands
it with its records (so the index need not validate the recorded request again), which must equal
those it parses back from the record."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from proxy.conversations.tree import SessionTree, chat_record
from proxy.openai.schemas import ChatCompletionRequest
from rewards.message_keys import message_key, tools_key
from storage.records import CompletionRecord
from tests.support.chat_conversation import CALL, FINAL, RESULT, SUMMARY, USER, call

_ids = itertools.count()


def record(
    messages: list[dict[str, Any]], answer: dict[str, Any], parent: str | None = None,
    tools: list[dict[str, Any]] | None = None, prompt: list[int] | None = None,
    output: list[int] | None = None, dropped: int = 0,
) -> CompletionRecord:
    output = output or [7, 8]
    request: dict[str, Any] = {"messages": messages}
    if tools:
        request["tools"] = tools
    return CompletionRecord(
        id=f"chatcmpl-{next(_ids)}", session_id="s", parent_id=parent, prompt_ids=prompt or [1, 2],
        output_ids=output, output_logprobs=[0.0] * len(output), output_versions=[0] * len(output),
        finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1, request_json=request,
        response_json={"choices": [{"index": 0, "message": answer}]}, dropped_messages=dropped,
    )


def keys(messages: list[dict[str, Any]]) -> list[Any]:
    return [message_key(m) for m in messages]


def test_the_deepest_extended_completion_is_chosen_and_rebuilt_from_suffixes() -> None:
    tree = SessionTree()
    first = record([USER], CALL, prompt=[1, 2], output=[3])
    second = record([RESULT], FINAL, parent=first.id, prompt=[4], output=[5, 6])
    assert tree.add_all([second, first])  # parents first whatever the order given

    follow_up = [USER, {**CALL, "tool_calls": [call("f", {"x": 1}, "client-id")]}, RESULT, FINAL,
                 {"role": "user", "content": "thanks"}]
    match = tree.deepest_prefix(None, keys(follow_up))
    assert match is not None and match.node.id == second.id and (match.length, match.dropped) == (4, 0)
    assert match.node.full_ids() == [1, 2, 3, 4, 5, 6]
    assert tree.deepest_prefix(None, keys(follow_up[:3])).node.id == first.id  # type: ignore[union-attr]
    assert tree.deepest_prefix(None, keys([USER])) is None  # nothing new after a completion: no parent
    assert tree.deepest_prefix(None, keys(follow_up[:2])) is None  # answer without a new message
    edited = [{"role": "user", "content": "hello"}, *follow_up[1:]]
    assert tree.deepest_prefix(None, keys(edited)) is None
    assert tree.deepest_prefix(tools_key([{"type": "function"}]), keys(follow_up)) is None  # other tools
    assert tree.is_branch(None, keys(follow_up[:2])) and not tree.is_branch(None, keys(edited))
    assert not tree.is_branch(None, keys([USER]))  # the first turn asked again: a resample
    assert not tree.is_branch(None, keys(follow_up[:3]))  # the second turn asked again


def test_only_unknown_assistant_messages_call_for_a_reload() -> None:
    tree = SessionTree()
    tree.add(record([USER], CALL))
    assert not tree.may_be_stale_for(keys([USER, CALL, RESULT]))  # every answer known
    assert not tree.may_be_stale_for(keys([{"role": "user", "content": "other"}]))
    unknown = [USER, CALL, RESULT, FINAL, SUMMARY]
    assert tree.may_be_stale_for(keys(unknown))  # FINAL may have been recorded by another proxy
    tree.note_foreign(keys(unknown))
    assert not tree.may_be_stale_for(keys(unknown))  # a reload did not find it: never reload for it again


def test_a_child_of_an_unknown_parent_is_refused() -> None:
    tree = SessionTree()
    assert not tree.add(record([RESULT], FINAL, parent="chatcmpl-gone"))
    assert tree.add(record([], FINAL)) and not tree.nodes  # not a chat request: ignored
    assert not tree.add_all([record([RESULT], FINAL, parent="chatcmpl-gone")])


def test_full_ids_are_int_lists() -> None:
    tree = SessionTree()
    first = record([USER], FINAL, prompt=[1], output=[2])
    tree.add(first)
    assert tree.nodes[first.id].full_ids() == [1, 2]
    assert isinstance(tree.nodes[first.id].prompt_ids, np.ndarray)


def test_a_busy_session_forgets_its_oldest_finished_turns() -> None:
    tree = SessionTree(max_nodes=3)
    first = record([USER], CALL)
    second = record([RESULT], FINAL, parent=first.id)
    others = [record([{"role": "user", "content": f"q{i}"}], FINAL) for i in range(2)]
    assert tree.add_all([first, second, *others])

    assert list(tree.nodes) == [first.id, others[0].id, others[1].id]  # the oldest leaf went first
    assert tree.nodes[first.id].children == 0  # its child is gone: it is a leaf now
    assert tree.deepest_prefix(None, keys([USER, CALL, RESULT, FINAL, SUMMARY])).node.id == first.id  # type: ignore[union-attr]
    assert not tree.add(record([SUMMARY], FINAL, parent=second.id))  # a child of a forgotten node


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]


def test_keys_handed_over_equal_the_keys_parsed_from_the_record() -> None:
    request = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    body = ChatCompletionRequest.model_validate(request)
    keys = (tuple(message_key(m) for m in body.template_messages()), tools_key(body.template_tools()))
    record = CompletionRecord(
        id="chatcmpl-1", session_id="s", parent_id=None, prompt_ids=[1, 2], output_ids=[7],
        output_logprobs=[0.0], output_versions=[0], finish_reason="stop", temperature=1.0, top_p=1.0,
        top_k=-1, request_json=request,
        response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "It is 42."}}]},
    )
    assert chat_record(record, keys) == chat_record(record) is not None
    parsed, handed = SessionTree(), SessionTree()
    assert parsed.add(record) and handed.add(record, keys)
    assert parsed.nodes["chatcmpl-1"].path == handed.nodes["chatcmpl-1"].path
    assert parsed.nodes["chatcmpl-1"].path_hash == handed.nodes["chatcmpl-1"].path_hash


SYSTEM = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Read hello.txt"}


def context(turn: int) -> dict[str, Any]:
    """An agent's ephemeral context message: appended to every request, left out of the next."""
    return {"role": "user", "content": f"<<<CONTEXT>>> turn {turn}: active sessions none <<<END>>>"}


def test_a_call_that_drops_its_parents_trailing_context_still_extends_it() -> None:
    tree = SessionTree()
    first = record([SYSTEM, TASK, context(1)], CALL)
    assert tree.add(first)

    second_call = [SYSTEM, TASK, CALL, RESULT, context(2)]
    match = tree.deepest_prefix(None, keys(second_call))
    assert match is not None and match.node.id == first.id and (match.length, match.dropped) == (3, 1)
    # Recorded with what it dropped, the second turn's own path leaves the context out too, so a third
    # call (which dropped both contexts) extends it, as does a tree rebuilt from the records alone.
    second = record(second_call[match.length:], FINAL, parent=first.id, dropped=match.dropped)
    third_call = [SYSTEM, TASK, CALL, RESULT, FINAL, {"role": "user", "content": "thanks"}, context(3)]
    for rebuilt in (tree, SessionTree()):
        assert rebuilt.add_all([first, second])
        found = rebuilt.deepest_prefix(None, keys(third_call))
        assert found is not None and found.node.id == second.id and (found.length, found.dropped) == (5, 1)


def test_a_call_matching_whole_wins_and_ephemeral_matching_can_be_turned_off() -> None:
    tree = SessionTree()
    first = record([SYSTEM, TASK, context(1)], CALL)
    tree.add(first)
    kept = [SYSTEM, TASK, context(1), CALL, RESULT]  # an agent that keeps the message: an ordinary chain
    assert tree.deepest_prefix(None, keys(kept)).dropped == 0  # type: ignore[union-attr]
    strict = SessionTree(ephemeral_max=0)
    strict.add(first)
    dropped = [SYSTEM, TASK, CALL, RESULT]
    assert strict.deepest_prefix(None, keys(dropped)) is None
    assert strict.is_branch(None, keys(dropped))


def test_only_trailing_context_after_a_real_message_may_be_dropped() -> None:
    tree = SessionTree(ephemeral_max=2)
    alone = record([{"role": "user", "content": "q"}], CALL)  # its only message is the question itself
    tool_last = record([TASK, CALL, RESULT], FINAL)  # a tool result is never ephemeral
    tree.add_all([alone, tool_last])
    assert tree.deepest_prefix(None, keys([CALL, RESULT])) is None
    assert tree.deepest_prefix(None, keys([TASK, CALL, FINAL, SUMMARY])) is None
    # Rewritten history, as smolagents sends its tool calls back as text, is still no match: a branch.
    two = record([SYSTEM, TASK, context(1), context(2)], CALL)
    tree.add(two)
    assert tree.deepest_prefix(None, keys([SYSTEM, TASK, CALL, RESULT])).dropped == 2  # type: ignore[union-attr]
    as_text = [SYSTEM, TASK, {"role": "assistant", "content": "Calling tools: f(x=1)"},
               {"role": "user", "content": "Observation: 42"}]
    assert tree.deepest_prefix(None, keys(as_text)) is None and tree.is_branch(None, keys(as_text))


def test_forgotten_nodes_leave_no_shortened_entries() -> None:
    tree = SessionTree(max_nodes=1)
    tree.add(record([SYSTEM, TASK, context(1)], CALL))
    tree.add(record([{"role": "user", "content": "other"}], FINAL))
    assert len(tree.nodes) == 1 and not tree.by_shortened
