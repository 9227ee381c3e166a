"""proxy.conversations.ConversationIndex's memory bounds (proxy.conversation_sessions_max and
proxy.conversation_nodes_max): trees beyond the session limit drop out least recently used first, a tree
keeps at most its node limit, and a dropped tree comes back whole from the database."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from proxy.config import ProxyConfig
from proxy.conversations.index import ConversationIndex
from rewards.message_keys import MessageKey, message_key
from storage.engine import SessionFactory
from storage.queries import create_session, record_completions
from storage.records import CompletionRecord, SessionRecord


def turn(completion_id: str, session_id: str, parent_id: str | None) -> CompletionRecord:
    return CompletionRecord(
        id=completion_id, session_id=session_id, parent_id=parent_id, prompt_ids=[1, 2], output_ids=[3],
        output_logprobs=[-0.5], output_versions=[0], finish_reason="stop", temperature=1.0, top_p=1.0,
        top_k=-1, request_json={"messages": [{"role": "user", "content": completion_id}]},
        response_json={"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
    )


async def test_sessions_and_nodes_are_bounded_and_reload(session_factory: SessionFactory) -> None:
    for session_id in ("s1", "s2"):
        await create_session(session_factory, SessionRecord(id=session_id, key_hash=session_id * 32))
        turns = [turn(f"{session_id}-{i}", session_id, None) for i in range(3)]  # three conversations
        await record_completions(session_factory, turns)
    index = ConversationIndex(session_factory, max_sessions=1, max_nodes=2)
    first, loaded = await index.tree("s1")
    assert loaded and len(first.nodes) == 2  # the node limit holds on load
    _second, loaded = await index.tree("s2")
    assert loaded and len(index) == 1  # s1 dropped out: least recently used
    again, loaded = await index.tree("s1")
    assert loaded and again is not first and len(again.nodes) == 2  # back from the database
    same, loaded = await index.tree("s1")
    assert not loaded and same is again


def test_the_bounds_are_config_and_must_be_positive() -> None:
    config = ProxyConfig(conversation_sessions_max=8, conversation_nodes_max=100)
    assert (config.conversation_sessions_max, config.conversation_nodes_max) == (8, 100)
    assert ProxyConfig().conversation_sessions_max == 4096
    with pytest.raises(ValidationError):
        ProxyConfig(conversation_nodes_max=0)


def answered(
    completion_id: str, session_id: str, answer: str, parent_id: str | None = None
) -> CompletionRecord:
    response = {"choices": [{"message": {"role": "assistant", "content": answer}}]}
    return dataclasses.replace(turn(completion_id, session_id, parent_id), response_json=response)


def said(text: str) -> list[MessageKey]:
    user = message_key({"role": "user", "content": "hi"})
    return [user, message_key({"role": "assistant", "content": text})]


async def test_the_sessions_answering_a_message_follow_the_trees_held(
    session_factory: SessionFactory,
) -> None:
    for session_id, answer in (("s1", "red"), ("s2", "blue"), ("s3", "red")):
        await create_session(session_factory, SessionRecord(id=session_id, key_hash=session_id * 32))
        await record_completions(session_factory, [answered(f"{session_id}-0", session_id, answer)])
    index = ConversationIndex(session_factory, max_sessions=2)
    assert index.sessions_answering(said("red")) == set()  # nothing held yet
    await index.tree("s1")
    await index.tree("s2")
    assert index.sessions_answering(said("red")) == {"s1"}
    assert index.sessions_answering(said("blue")) == {"s2"}
    red_question = message_key({"role": "user", "content": "red"})
    assert index.sessions_answering([red_question]) == set()  # answers only

    # A completion learned joins its answer; an unknown parent drops the whole tree from the index.
    green = answered("s2-1", "s2", "green", parent_id="s2-0")
    await record_completions(session_factory, [green])  # as the recorder does, then tells the index
    index.learn([green])
    assert index.sessions_answering(said("green")) == {"s2"}
    index.learn([answered("s2-2", "s2", "gold", parent_id="elsewhere")])
    assert not index.holds("s2") and index.sessions_answering(said("green") + said("blue")) == set()

    await index.tree("s3")
    await index.tree("s2")  # s1 is the least recently used of three: dropped, and from the index
    assert not index.holds("s1") and index.sessions_answering(said("red")) == {"s3"}
    assert index.sessions_answering(said("green")) == {"s2"}  # s2 back from the database, whole
    await index.tree("s3", reload=True)  # a reload replaces the tree and keeps its answers indexed
    assert index.sessions_answering(said("red")) == {"s3"}
