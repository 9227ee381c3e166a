"""Grouping an online key's live traffic (proxy/conversations/online.py, docs/online.md), with
the real `openai` client against a real proxy and scripted workers: a conversation hint holds an agent
that rewrites its history to one session (chained where the history allows, flagged branches where it
does not); a new unhinted conversation ends the key's last one; a call the client retried after a
timeout leaves a retry orphan, which finalization marks, counts and keeps out of training."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from proxy.auth import create_online_key
from rewards.config import HookRunnerConfig, RewardsConfig
from rewards.hooks.spec import HookSpec
from tests.support.databases import key_hasher
from tests.support.delaying_worker import start_delaying_worker
from tests.support.finalizing import session_trajectories
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory, metric, run_db, session_completions
from tests.support.scripted_worker import ScriptedWorker

HINT = "X-Flywheel-Conversation"
SESSION_HEADER = "x-flywheel-session-id"
TIMEOUT_S = 2.0  # the impatient client's
ABANDONED_S = 3 * TIMEOUT_S  # how long the worker holds the first attempt back


def online_key(proxy: Proxy) -> str:
    hasher = key_hasher(proxy.db_url)
    return run_db(proxy.db_url, lambda factory: create_online_key(factory, hasher))


def chat(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, str, str]:
    """(session id, completion id, text) of one chat call."""
    raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=4)
    completion = raw.parse()
    return raw.headers[SESSION_HEADER], completion.id, completion.choices[0].message.content or ""


def rl(proxy: Proxy, key: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(
        method, f"{proxy.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def statuses(proxy: Proxy) -> dict[str, str]:
    return {session.id: session.status for session in proxy.sessions()}


def wait_for(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def test_a_hint_holds_a_rewritten_history_in_one_session(
    proxies: ProxyFactory, scripted: ScriptedWorker, db_url: str
) -> None:
    """An agent that re-sends its own answers rewritten (smolagents renders its tool calls as text)
    never extends an earlier call; with a hint its calls stay in one session: the rewritten turn is a
    flagged branch, the turn extending it chains token-exactly. Its Responses and legacy calls join too;
    another hint, or no hint at all, never does."""
    proxy = proxies.start([scripted.url], health_check_interval_s=0)
    key = online_key(proxy)
    hinted = proxy.client(key, default_headers={HINT: "task-7"})

    task = [{"role": "user", "content": "What is 2 + 3?"}]
    session_id, first, _answer = chat(hinted, task)
    rewritten = [
        *task,
        {"role": "assistant", "content": "Thought: add them.\nAction: add(2, 3)"},
        {"role": "user", "content": "Observation: 5"},
    ]
    joined, second, answer = chat(hinted, rewritten)
    extended = [*rewritten, {"role": "assistant", "content": answer}, {"role": "user", "content": "So?"}]
    chained, third, answer = chat(hinted, extended)
    assert joined == chained == session_id

    rows = {row.id: row for row in session_completions(proxy, session_id)}
    assert rows[first].parent_id is None and not rows[first].branched
    assert rows[second].parent_id is None and rows[second].branched
    assert rows[third].parent_id == second and not rows[third].branched
    sent = [request.body["input_ids"] for request in scripted.requests_to("/generate")]
    parent, child = rows[second], rows[third]
    chain = [*parent.prompt_ids.tolist(), *parent.output_ids.tolist(), *child.prompt_ids.tolist()]
    assert chain in sent  # the chained turn reached the worker token-exactly

    responses = hinted.responses.with_raw_response.create(model="m", input="And 4 + 4?", max_output_tokens=4)
    legacy = hinted.completions.with_raw_response.create(model="m", prompt="2 + 3 =", max_tokens=4)
    assert responses.headers[SESSION_HEADER] == legacy.headers[SESSION_HEADER] == session_id

    assert chat(proxy.client(key, default_headers={HINT: "task-8"}), task)[0] != session_id
    # Without a hint, even a call extending the hinted conversation exactly starts a session of its own.
    went_on = [*extended, {"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks."}]
    unhinted = chat(proxy.client(key), went_on)[0]
    assert unhinted != session_id

    sessions = {session.id: session for session in proxy.sessions()}
    assert sessions[session_id].conversation == "task-7" and sessions[session_id].status == "active"
    assert sessions[session_id].owner_key_hash == key_hasher(db_url).hash(key)
    assert sessions[unhinted].conversation is None


def test_calls_opening_one_hinted_conversation_at_once_share_one_session(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    """An agent's first calls of a task may run in parallel (a guardrail beside the first turn): none
    of them finds the hint's session, and they must still open only one."""
    proxy = proxies.start([scripted.url], health_check_interval_s=0)
    key = online_key(proxy)
    client = proxy.async_client(key, default_headers={HINT: "parallel"})

    async def opening(i: int) -> str:
        messages = [{"role": "user", "content": f"Part {i} of the task."}]
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=2
        )
        return raw.headers[SESSION_HEADER]

    async def all_at_once() -> list[str]:
        return list(await asyncio.gather(*(opening(i) for i in range(6))))

    joined = asyncio.run(all_at_once())
    assert len(set(joined)) == 1
    assert [s.id for s in proxy.sessions() if s.conversation == "parallel"] == joined[:1]


def test_a_bad_hint_is_refused_and_other_keys_hints_are_ignored(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    proxy = proxies.start([scripted.url], health_check_interval_s=0)
    key = online_key(proxy)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    before = statuses(proxy)
    for bad in (b"", b"x" * 129, b"tab\there", "café".encode()):
        answer = httpx.post(
            f"{proxy.v1}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}", HINT: bad}
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == HINT
    assert statuses(proxy) == before  # a refused call opens nothing

    longest = chat(proxy.client(key, default_headers={HINT: "~" * 128}), body["messages"])[0]
    # A session key always has its own session, an admin call a one-off one: their hints mean nothing.
    for other in (proxy.session_key, proxy.admin_key):
        answer = httpx.post(
            f"{proxy.v1}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {other}", HINT: "x" * 200},
        )
        assert answer.status_code == 200, answer.text
    sessions = {session.id: session for session in proxy.sessions()}
    assert sessions[longest].conversation == "~" * 128
    assert [s.id for s in sessions.values() if s.conversation is not None] == [longest]


def test_a_new_conversation_ends_the_last_unhinted_one(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    """The key's older unhinted session ends as the RL API ends it (its reward hooks queued); its hinted
    sessions, and the new one, stay active."""
    rewards = RewardsConfig(online_hooks=[HookSpec(hook="exact")], runner=HookRunnerConfig(in_proxy=False))
    proxy = proxies.start([scripted.url], rewards=rewards, health_check_interval_s=0)
    key = online_key(proxy)
    client = proxy.client(key)
    support = proxy.client(key, default_headers={HINT: "support-42"})
    hinted = chat(support, [{"role": "user", "content": "Hi"}])[0]

    trip = [{"role": "user", "content": "Plan a trip."}]
    last, _, answer = chat(client, trip)
    more = [*trip, {"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    assert chat(client, more)[0] == last
    assert statuses(proxy)[last] == "active"  # a turn of the same conversation ends nothing
    new = chat(client, [{"role": "user", "content": "Write a poem."}])[0]

    wait_for(lambda: statuses(proxy)[last] == "ended")
    assert {sid: statuses(proxy)[sid] for sid in (hinted, new)} == {hinted: "active", new: "active"}
    view = rl(proxy, key, "GET", f"/rl/v1/sessions/{last}").json()
    assert [(hook["source"], hook["state"]) for hook in view["hooks"]] == [("hook:exact", "queued")]


def test_a_retried_call_leaves_one_orphan_that_trains_nothing(
    proxies: ProxyFactory, servers: LoopThread
) -> None:
    """The openai client gives up on a slow call and retries it; the worker still answers the first
    attempt, which the proxy records. The conversation goes on from the retry's answer. Finalized, the
    session has one chain to train, and the first attempt is marked and counted as its retry orphan."""
    worker = start_delaying_worker(servers)
    try:
        proxy = proxies.start([worker.url], health_check_interval_s=0)
        key = online_key(proxy)
        client = proxy.client(key)
        task = [{"role": "user", "content": "Plan a trip."}]
        session_id, first, answer = chat(client, task)

        asked = [*task, {"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
        worker.delay_next(ABANDONED_S)
        impatient = openai.OpenAI(base_url=proxy.v1, api_key=key, timeout=TIMEOUT_S, max_retries=1)
        raw = impatient.chat.completions.with_raw_response.create(model="m", messages=asked, max_tokens=4)
        assert raw.retries_taken == 1 and raw.headers[SESSION_HEADER] == session_id
        kept = raw.parse()
        went_on = [
            *asked,
            {"role": "assistant", "content": kept.choices[0].message.content},
            {"role": "user", "content": "Thanks."},
        ]
        assert chat(client, went_on)[0] == session_id

        assert (
            rl(proxy, key, "POST", f"/rl/v1/sessions/{session_id}/reward", {"value": 1.0}).status_code == 200
        )
        assert rl(proxy, key, "POST", f"/rl/v1/sessions/{session_id}/end").status_code == 200
        # Finalization waits for the abandoned attempt to be recorded.
        wait_for(lambda: statuses(proxy)[session_id] == "finalized", timeout_s=ABANDONED_S + 30)

        completions = rl(proxy, key, "GET", f"/rl/v1/sessions/{session_id}").json()["completions"]
        assert len(completions) == 4
        [orphan] = [c for c in completions if c["orphan_of"] is not None]
        assert orphan["orphan_of"] == kept.id and orphan["parent_id"] == first and orphan["id"] != kept.id
        assert proxy.completion(orphan["id"]).orphan_of == kept.id
        assert metric(proxy.base_url, "flywheel_retry_orphans_total") == 1.0

        [trajectory] = run_db(proxy.db_url, lambda factory: session_trajectories(factory, session_id))
        assert first in trajectory.completion_ids and kept.id in trajectory.completion_ids
        assert orphan["id"] not in trajectory.completion_ids
    finally:
        servers.call(worker.stop())
