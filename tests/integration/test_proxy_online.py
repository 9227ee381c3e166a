"""Online keys: `flywheel keys create --online` makes a long-lived key whose calls (real `openai` client,
real proxy) are grouped into sessions by conversation: a call extending one of the key's active
sessions joins it and chains token-exactly; any other call starts a session the key owns, rewards and
ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.databases import key_hasher, storage_overrides
from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker

SESSION_HEADER = "x-flywheel-session-id"
INTERLEAVED = {"end_on_new_conversation": False}
"""For the tests holding several unhinted conversations of one key at once: else each new one ends the
last (tests/integration/test_online_grouping.py)."""


def create_online_key(db_url: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "keys", "create", "--online", *storage_overrides(db_url)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    assert key.startswith("fw-online-")
    return key


def call(proxy: Proxy, key: str, messages: list[dict[str, Any]], stream: bool = False) -> tuple[str, str]:
    """(session id, assistant text) of one chat call on `key`."""
    raw = proxy.client(key).chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=4, stream=stream,  # type: ignore[call-overload]
    )
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return raw.headers[SESSION_HEADER], text


def rl(proxy: Proxy, key: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{proxy.base_url}{path}", json=body or {}, headers={"Authorization": f"Bearer {key}"})


def test_online_key_calls_join_sessions_by_conversation(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    proxy = proxies.start([scripted.url], health_check_interval_s=0, online=INTERLEAVED)
    key = create_online_key(db_url, tmp_path)

    trip = [{"role": "user", "content": "Plan a trip."}]
    poem = [{"role": "user", "content": "Write a poem."}]
    trip_session, trip_answer = call(proxy, key, trip)
    poem_session, poem_answer = call(proxy, key, poem, stream=True)
    assert trip_session != poem_session

    trip += [{"role": "assistant", "content": trip_answer}, {"role": "user", "content": "More."}]
    poem += [{"role": "assistant", "content": poem_answer}, {"role": "user", "content": "Shorter."}]
    assert call(proxy, key, poem)[0] == poem_session
    assert call(proxy, key, trip, stream=True)[0] == trip_session

    sessions = {s.id: s for s in proxy.sessions()}
    for sid in (trip_session, poem_session):
        assert sessions[sid].owner_key_hash == key_hasher(db_url).hash(key)
        assert sessions[sid].metadata_["origin"] == "online"
        rows = sorted((c for c in proxy.completions() if c.session_id == sid), key=lambda c: c.created_at)
        assert len(rows) == 2 and rows[1].parent_id == rows[0].id and not rows[1].branched
        requests = [r.body["input_ids"] for r in scripted.requests_to("/generate")]
        chained = [*rows[0].prompt_ids.tolist(), *rows[0].output_ids.tolist(), *rows[1].prompt_ids.tolist()]
        assert chained in requests  # the second turn's prompt reached the worker token-exactly

    second = rows[1].id  # the poem's second turn
    assert rl(proxy, key, f"/rl/v1/completions/{second}/reward", {"value": 1.0}).status_code == 200
    assert rl(proxy, key, f"/rl/v1/sessions/{trip_session}/reward", {"value": 0.5}).status_code == 200
    not_owned = rl(proxy, key, f"/rl/v1/sessions/{proxy.session_id}/reward", {"value": 1.0})
    assert not_owned.status_code == 403 and not_owned.json()["error"]["code"] == "wrong_session"
    ended = rl(proxy, key, f"/rl/v1/sessions/{trip_session}/end")
    assert ended.status_code == 200 and ended.json()["ended"] is True

    # The trip's session has ended: extending its conversation now starts a new session.
    trip += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Thanks."}]
    later_session, _ = call(proxy, key, trip)
    assert later_session not in (trip_session, poem_session)
    later = [c for c in proxy.completions() if c.session_id == later_session]
    assert len(later) == 1 and later[0].parent_id is None and not later[0].branched


def test_online_key_responses_calls_get_sessions_it_owns(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    proxy = proxies.start([scripted.url], health_check_interval_s=0)
    key = create_online_key(db_url, tmp_path)

    raw = proxy.client(key).responses.with_raw_response.create(model="m", input="Count.", max_output_tokens=4)
    session_id = raw.headers[SESSION_HEADER]
    assert raw.parse().id.startswith("resp_")

    session = {s.id: s for s in proxy.sessions()}[session_id]
    assert session.owner_key_hash == key_hasher(db_url).hash(key) and session.status == "active"
    assert rl(proxy, key, f"/rl/v1/sessions/{session_id}/end").status_code == 200


def test_online_conversations_find_their_sessions_beyond_the_trees_held(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    """With one session tree in memory, three conversations continued in turn each rejoin their own
    session (the others' trees come back from the database) and chain onto their last turn; a first call
    that carries few-shot assistant turns no completion answered starts a session of its own."""
    proxy = proxies.start([scripted.url], health_check_interval_s=0, conversation_sessions_max=1,
                          online=INTERLEAVED)
    key = create_online_key(db_url, tmp_path)
    conversations: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for topic in ("trip", "poem", "song"):
        messages = [{"role": "user", "content": f"About a {topic}."}]
        session_id, answer = call(proxy, key, messages)
        conversations[topic] = (session_id, [*messages, {"role": "assistant", "content": answer}])
    assert len({session_id for session_id, _ in conversations.values()}) == 3

    for turn in range(2):
        for session_id, messages in conversations.values():
            messages.append({"role": "user", "content": f"More, {turn}."})
            joined, answer = call(proxy, key, messages, stream=turn == 1)
            assert joined == session_id
            messages.append({"role": "assistant", "content": answer})
    for session_id, _ in conversations.values():
        rows = sorted(
            (c for c in proxy.completions() if c.session_id == session_id), key=lambda c: c.created_at
        )
        assert [row.parent_id for row in rows] == [None, rows[0].id, rows[1].id]

    few_shot = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3 + 3?"}]
    started, answer = call(proxy, key, few_shot)
    assert started not in {session_id for session_id, _ in conversations.values()}
    follow_up = [*few_shot, {"role": "assistant", "content": answer}, {"role": "user", "content": "4 + 4?"}]
    assert call(proxy, key, follow_up)[0] == started


def test_online_key_text_completions_get_sessions_it_owns(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    """A legacy /v1/completions call on an online key is a conversation of its own: its session is the
    key's (active, rewardable and endable by it), never an admin call's one-off session nobody trains on."""
    proxy = proxies.start([scripted.url], health_check_interval_s=0, online=INTERLEAVED)
    key = create_online_key(db_url, tmp_path)
    client = proxy.client(key)

    raw = client.completions.with_raw_response.create(model="m", prompt="Once upon a time", max_tokens=4)
    session_id = raw.headers[SESSION_HEADER]
    completion = raw.parse()
    streamed = client.completions.with_raw_response.create(
        model="m", prompt=[5, 6, 7], max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed.parse() if c.choices)
    assert streamed.headers[SESSION_HEADER] != session_id

    sessions = {s.id: s for s in proxy.sessions()}
    owner = key_hasher(db_url).hash(key)
    for sid in (session_id, streamed.headers[SESSION_HEADER]):
        assert sessions[sid].owner_key_hash == owner and sessions[sid].status == "active"
        assert sessions[sid].metadata_["origin"] == "online"
    [row] = [c for c in proxy.completions() if c.session_id == session_id]
    assert completion.id.startswith("cmpl-") and row.output_ids.tolist()
    assert rl(proxy, key, f"/rl/v1/sessions/{session_id}/reward", {"value": 1.0}).status_code == 200
    assert rl(proxy, key, f"/rl/v1/sessions/{session_id}/end").json()["ended"] is True


def test_online_key_reads_and_continues_its_own_stored_responses_only(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str, tmp_path: Path
) -> None:
    """GET /v1/responses/{id} and previous_response_id see a response made on an online key, since the
    key owns its session; to another online key it is as unknown as a missing one (404)."""
    proxy = proxies.start([scripted.url], health_check_interval_s=0)
    key, other_key = create_online_key(db_url, tmp_path), create_online_key(db_url, tmp_path)
    client = proxy.client(key)

    raw = client.responses.with_raw_response.create(model="m", input="Count.", max_output_tokens=4)
    first = raw.parse()
    assert client.responses.retrieve(first.id).id == first.id
    continued = client.responses.with_raw_response.create(
        model="m", input="More.", previous_response_id=first.id, max_output_tokens=4
    )
    assert continued.parse().previous_response_id == first.id
    assert continued.headers[SESSION_HEADER] == raw.headers[SESSION_HEADER]  # the same conversation
    assert proxy.completion(continued.parse().id).parent_id == first.id

    other = proxy.client(other_key)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as refused:
        other.responses.create(model="m", input="Mine?", previous_response_id=first.id, max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
