"""The RL loop's front half over real HTTP, on SQLite and Postgres: a real uvicorn proxy in front of the
scripted SGLang worker; agents chat with the real `openai` client on session keys handed out by the RL
API, rewards and ends go over REST, the finalizer writes trajectories that match the recorded
completions field by field, and the trainer's claim takes the whole group."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sqlalchemy import select

from storage.claims import claim_batch
from storage.engine import SessionFactory
from storage.models import Trajectory
from storage.queries import load_completion_chain
from storage.records import ClaimedBatch
from storage.sequences import full_prompt_ids
from tests.support.proxy_harness import Proxy, ProxyFactory, run_db
from tests.support.scripted_worker import ScriptedWorker

FINALIZER = {"sweep_interval_s": 0.2, "turn_discount": 1.0, "style": "individual"}


def rest(proxy: Proxy, key: str, method: str, path: str, body: Any = None) -> httpx.Response:
    with httpx.Client(base_url=proxy.base_url, timeout=30) as client:
        return client.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def status(proxy: Proxy, session_id: str) -> str:
    return str(rest(proxy, proxy.admin_key, "GET", f"/rl/v1/sessions/{session_id}").json()["status"])


def chat_two_turns(base_url: str, key: str, temperature: float) -> list[str]:
    """An agent: two calls, the second continuing the conversation; returns the completion ids."""
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    create = client.chat.completions.create
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    first = create(model="m", messages=messages, max_tokens=5, temperature=temperature)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Are you sure?"}]
    second = create(model="m", messages=messages, max_tokens=4, temperature=temperature)
    return [first.id, second.id]


async def _trajectories(session_factory: SessionFactory, session_ids: list[str]) -> list[Trajectory]:
    async with session_factory() as db:
        query = select(Trajectory).where(Trajectory.session_id.in_(session_ids)).order_by(Trajectory.id)
        return list((await db.execute(query)).scalars())


def chain_of(proxy: Proxy, completion_id: str) -> Any:
    async def load(session_factory: SessionFactory) -> Any:
        return await load_completion_chain(session_factory, completion_id)

    return run_db(proxy.db_url, load)


def test_group_chats_rewards_ends_and_is_claimed_whole(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    proxy = proxies.start([scripted.url], finalizer=FINALIZER)
    created = rest(proxy, proxy.admin_key, "POST", "/rl/v1/groups", {"size": 4, "task": {"q": "2+2"}})
    assert created.status_code == 201, created.text
    group = created.json()
    assert group["base_url"] == proxy.v1

    completions: dict[str, list[str]] = {}
    for i, member in enumerate(group["sessions"]):
        sid, key = member["session_id"], member["api_key"]
        completions[sid] = chat_two_turns(group["base_url"], key, temperature=0.5 + 0.1 * i)
        rewarded = rest(proxy, key, "POST", f"/rl/v1/sessions/{sid}/reward", {"value": float(i)})
        assert rewarded.status_code == 200
        assert rest(proxy, key, "POST", f"/rl/v1/sessions/{sid}/end").json()["status"] == "ended"

        with pytest.raises(openai.AuthenticationError) as refused:  # the ended session's key stops working
            openai.OpenAI(base_url=group["base_url"], api_key=key, max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"

    session_ids = list(completions)
    wait_until(lambda: all(status(proxy, sid) == "finalized" for sid in session_ids))

    trajectories = run_db(proxy.db_url, lambda f: _trajectories(f, session_ids))
    by_session: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_session.setdefault(t.session_id, []).append(t)
    for i, sid in enumerate(session_ids):
        rows = by_session[sid]
        assert len(rows) == len(completions[sid]) == 2
        for row, completion_id in zip(rows, completions[sid], strict=True):
            chain = chain_of(proxy, completion_id)
            completion = chain[-1]
            prompt = full_prompt_ids(chain).tolist()
            output = np.asarray(completion.output_ids).tolist()
            n = len(prompt)
            assert row.token_ids.tolist() == prompt + output
            assert row.loss_mask.tolist() == [False] * n + [True] * len(output)
            assert row.logprobs.tolist() == [0.0] * n + np.asarray(completion.output_logprobs).tolist()
            assert row.versions.tolist() == [-1] * n + np.asarray(completion.output_versions).tolist()
            assert row.temperature == pytest.approx(0.5 + 0.1 * i) == completion.temperature
            assert row.reward == float(i)  # γ = 1: each turn carries the session reward
            assert row.group_id == group["group_id"]
            assert row.min_version == int(np.min(completion.output_versions))

    newest = max(int(t.versions.max()) for t in trajectories)
    batch: ClaimedBatch = run_db(
        proxy.db_url, lambda f: claim_batch(f, size=8, current_version=newest, max_staleness=newest + 1)
    )
    assert sorted(batch.ids) == sorted(t.id for t in trajectories)
    assert {s.group_id for s in batch.samples} == {group["group_id"]}


def test_areal_client_flow_over_http(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    proxy = proxies.start([scripted.url], finalizer=FINALIZER)
    started = rest(proxy, proxy.admin_key, "POST", "/rl/start_session", {"task_id": "gsm8k-1"})
    assert started.status_code == 200 and set(started.json()) == {"session_id", "api_key"}
    sid, key = started.json()["session_id"], started.json()["api_key"]

    client = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)  # AReaL's root /chat route
    first, second = (
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=3)
        for q in ("a?", "b?")
    )
    assert rest(proxy, key, "POST", "/rl/set_reward", {"reward": 1.0}).json() == {"message": "success"}
    not_mine = {"reward": 1.0, "interaction_id": first.id}
    other = rest(proxy, proxy.session_key, "POST", "/rl/set_reward", not_mine)
    assert other.status_code == 403 and other.json()["error"]["code"] == "wrong_session"
    ended = rest(proxy, key, "POST", "/rl/end_session", {})
    assert ended.json() == {"message": "success", "interaction_count": 2}

    wait_until(lambda: status(proxy, sid) == "finalized")
    rows = run_db(proxy.db_url, lambda f: _trajectories(f, [sid]))
    assert [t.reward for t in rows] == [1.0, 1.0]  # γ = 1; the reward is on the last completion
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "c?"}], max_tokens=2)
    assert second.id != first.id
