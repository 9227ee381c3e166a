"""The RL control API in-process (httpx over ASGI, the app's lifespan run, so the finalizer can be
awaited) on SQLite and Postgres: shapes, auth, refusals that write nothing, finalization, AReaL aliases."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from proxy.app import create_proxy_app
from proxy.auth import create_admin_key, create_online_key
from proxy.config import ProxyConfig
from proxy.services import ProxyServices
from rewards.config import FinalizerConfig
from serving.config import ServingConfig
from storage.models import ApiKey, Completion, Group, Reward, Session, Trajectory
from storage.queries import record_completions
from storage.records import CompletionRecord
from tests.support.databases import storage_config
from tests.support.proxy_harness import dead_worker_url

BASE_URL = "http://agents.example:9000/v1"
COUNTED = (ApiKey, Group, Session, Completion, Reward, Trajectory)


class Api:
    """An httpx client on the app, with its services and an admin key."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient, admin_key: str) -> None:
        self.app = app
        self.client = client
        self.admin_key = admin_key

    @property
    def services(self) -> ProxyServices:
        services: ProxyServices = self.app.state.services
        return services

    async def call(self, method: str, path: str, key: str | None, body: Any = None, raw: str | None = None
                   ) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        content = raw if raw is not None else (None if body is None else json.dumps(body))
        if content is not None:
            headers["Content-Type"] = "application/json"
        return await self.client.request(method, path, headers=headers, content=content)

    async def counts(self) -> dict[str, int]:
        async with self.services.session_factory() as db:
            return {
                m.__tablename__: int((await db.execute(select(func.count()).select_from(m))).scalar_one())
                for m in COUNTED
            }

    async def new_session(self, **body: Any) -> dict[str, Any]:
        response = await self.call("POST", "/rl/v1/sessions", self.admin_key, body)
        assert response.status_code == 201, response.text
        return dict(response.json())

    async def add_completions(self, session_id: str, n: int) -> list[str]:
        """`n` chained completions, as the proxy would record them for a multi-turn chat."""
        records: list[CompletionRecord] = []
        for i in range(n):
            records.append(
                CompletionRecord(
                    id=f"chatcmpl-{session_id}-{i}", session_id=session_id,
                    parent_id=records[-1].id if records else None, prompt_ids=[1 + i, 2 + i],
                    output_ids=[10 + i, 11 + i, 12 + i], output_logprobs=np.full(3, -0.5, np.float32),
                    output_versions=[0, 0, 0], finish_reason="stop", temperature=0.9, top_p=1.0, top_k=-1,
                    request_json={}, response_json={},
                )
            )
            await record_completions(self.services.session_factory, [records[-1]])
        return [r.id for r in records]

    async def trajectories(self, session_id: str) -> list[Trajectory]:
        async with self.services.session_factory() as db:
            query = select(Trajectory).where(Trajectory.session_id == session_id).order_by(Trajectory.id)
            return list((await db.execute(query)).scalars())

    async def settle(self) -> None:
        assert self.services.finalizer is not None
        await self.services.finalizer.wait_idle()


@pytest.fixture
async def api(db_url: str, tiny_model_dir: Path) -> AsyncIterator[Api]:
    config = ProxyConfig(public_base_url=BASE_URL, finalizer=FinalizerConfig(sweep_interval_s=3600))
    serving = ServingConfig(model=str(tiny_model_dir), worker_urls=[dead_worker_url()])
    app = create_proxy_app(config, storage_config(db_url), serving)
    async with app.router.lifespan_context(app):
        services = app.state.services
        admin_key = await create_admin_key(services.session_factory, services.key_hasher)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield Api(app, client, admin_key)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return dict(error)


async def test_create_session_and_group(api: Api) -> None:
    created = await api.new_session(task={"q": "2+2"}, metadata={"run": 1})
    assert set(created) == {"session_id", "api_key", "base_url"} and created["base_url"] == BASE_URL
    async with api.services.session_factory() as db:
        query = select(ApiKey).where(ApiKey.session_id == created["session_id"])
        key_row = (await db.execute(query)).scalar_one()
    assert key_row.key_hash == api.services.key_hasher.hash(created["api_key"]) and key_row.scope == "session"

    view = await api.call("GET", f"/rl/v1/sessions/{created['session_id']}", created["api_key"])
    assert view.status_code == 200
    assert view.json()["status"] == "active" and view.json()["task"] == {"q": "2+2"}
    assert view.json()["metadata"] == {"run": 1}

    response = await api.call("POST", "/rl/v1/groups", api.admin_key, {"size": 4, "task": "t"})
    assert response.status_code == 201
    group = response.json()
    assert len(group["sessions"]) == 4 and group["base_url"] == BASE_URL
    assert len({s["api_key"] for s in group["sessions"]}) == 4
    assert all(set(s) == {"session_id", "api_key"} for s in group["sessions"])

    before = await api.counts()
    full = await api.call("POST", "/rl/v1/sessions", api.admin_key, {"group_id": group["group_id"]})
    assert_openai_error(full, 409, "group_full")
    missing = await api.call("POST", "/rl/v1/sessions", api.admin_key, {"group_id": "grp_nope"})
    assert_openai_error(missing, 404, "group_not_found")
    for size in (0, 2000, "4", 2.5, None):
        assert_openai_error(await api.call("POST", "/rl/v1/groups", api.admin_key, {"size": size}), 422)
    assert_openai_error(await api.call("POST", "/rl/v1/groups", api.admin_key, {"size": 2, "x": 1}), 422)
    assert await api.counts() == before


async def test_auth(api: Api) -> None:
    session = await api.new_session()
    before = await api.counts()
    assert_openai_error(await api.call("POST", "/rl/v1/sessions", None, {}), 401)
    wrong_key = await api.call("POST", "/rl/v1/sessions", "fw-sess-wrong", {})
    assert_openai_error(wrong_key, 401, "invalid_api_key")
    assert_openai_error(await api.call("POST", "/rl/v1/groups", session["api_key"], {"size": 2}), 403)
    other = await api.new_session()
    after_other = await api.counts()
    for method, path in [
        ("GET", f"/rl/v1/sessions/{other['session_id']}"),
        ("POST", f"/rl/v1/sessions/{other['session_id']}/end"),
    ]:
        assert_openai_error(await api.call(method, path, session["api_key"]), 403, "wrong_session")
    assert await api.counts() == after_other
    assert after_other["sessions"] == before["sessions"] + 1


@pytest.mark.parametrize(
    "raw",
    ['{"value": "abc"}', '{"value": NaN}', '{"value": Infinity}', '{"value": -Infinity}', '{"value": 1e999}',
     '{"value": true}', '{"value": null}', '{"value": [1]}', "{}", '{"value": 1, "source": ""}',
     '{"value": 1, "extra": 2}'],
)
async def test_bad_reward_values_are_422_and_write_nothing(api: Api, raw: str) -> None:
    session = await api.new_session()
    (completion_id,) = await api.add_completions(session["session_id"], 1)
    before = await api.counts()
    paths = (f"/rl/v1/sessions/{session['session_id']}/reward", f"/rl/v1/completions/{completion_id}/reward")
    for path in paths:
        error = assert_openai_error(await api.call("POST", path, session["api_key"], raw=raw), 422)
        assert error["type"] == "invalid_request_error"
    assert await api.counts() == before


async def test_reward_refusals_write_nothing(api: Api) -> None:
    mine, theirs = await api.new_session(), await api.new_session()
    (their_completion,) = await api.add_completions(theirs["session_id"], 1)
    before = await api.counts()
    key = mine["api_key"]
    body = {"value": 1.0}
    assert_openai_error(await api.call("POST", f"/rl/v1/completions/{their_completion}/reward", key, body),
                        403, "wrong_session")
    their_session = await api.call("POST", f"/rl/v1/sessions/{theirs['session_id']}/reward", key, body)
    assert_openai_error(their_session, 403)
    assert_openai_error(await api.call("POST", "/rl/v1/completions/chatcmpl-nope/reward", key, body),
                        404, "completion_not_found")
    assert_openai_error(await api.call("POST", "/rl/v1/sessions/sess_nope/reward", key, body), 404)
    assert_openai_error(await api.call("POST", "/rl/v1/sessions/sess_nope/reward", api.admin_key, body), 404)
    assert_openai_error(await api.call("GET", "/rl/v1/sessions/sess_nope", api.admin_key), 404)
    assert_openai_error(await api.call("POST", "/rl/v1/sessions/sess_nope/end", api.admin_key), 404)
    bad_json = await api.call("POST", f"/rl/v1/sessions/{mine['session_id']}/reward", key, raw='{"value": ')
    assert_openai_error(bad_json, 400, "invalid_json")
    bad_key = await api.call("POST", f"/rl/v1/sessions/{mine['session_id']}/reward", "bad", body)
    assert_openai_error(bad_key, 401)
    assert await api.counts() == before


async def test_reward_end_finalize(api: Api) -> None:
    session = await api.new_session()
    sid, key = session["session_id"], session["api_key"]
    first, second = await api.add_completions(sid, 2)
    judged = {"value": 0.5, "source": "judge"}
    reward = await api.call("POST", f"/rl/v1/completions/{first}/reward", key, judged)
    assert reward.status_code == 200
    assert reward.json() == {
        "reward_id": reward.json()["reward_id"], "session_id": sid, "completion_id": first, **judged
    }
    assert (await api.call("POST", f"/rl/v1/sessions/{sid}/reward", key, {"value": 2})).status_code == 200

    end = await api.call("POST", f"/rl/v1/sessions/{sid}/end", key)
    assert end.json() == {"session_id": sid, "status": "ended", "ended": True}
    await api.settle()
    again = await api.call("POST", f"/rl/v1/sessions/{sid}/end", key)
    assert again.status_code == 200
    assert again.json() == {"session_id": sid, "status": "finalized", "ended": False}

    view = (await api.call("GET", f"/rl/v1/sessions/{sid}", key)).json()
    assert view["status"] == "finalized"
    assert [c["id"] for c in view["completions"]] == [first, second]
    assert [(c["prompt_tokens"], c["completion_tokens"], c["versions"]) for c in view["completions"]] == [
        (2, 3, [0]), (2 + 3 + 2, 3, [0])
    ]
    assert [(r["value"], r["completion_id"]) for r in view["rewards"]] == [(0.5, first), (2.0, None)]
    # One conversation chain, one trajectory: the session reward plus its completions' rewards.
    assert [t.reward for t in await api.trajectories(sid)] == [2.5]

    before = await api.counts()
    late = await api.call("POST", f"/rl/v1/sessions/{sid}/reward", key, {"value": 1})
    assert_openai_error(late, 409, "session_finalized")
    assert await api.counts() == before


async def test_ended_session_waits_for_its_reward(api: Api) -> None:
    session = await api.new_session()
    sid, key = session["session_id"], session["api_key"]
    await api.add_completions(sid, 1)
    await api.call("POST", f"/rl/v1/sessions/{sid}/end", key)
    await api.settle()
    assert (await api.call("GET", f"/rl/v1/sessions/{sid}", key)).json()["status"] == "ended"
    assert (await api.call("POST", f"/rl/v1/sessions/{sid}/reward", key, {"value": 1})).status_code == 200
    await api.settle()
    assert (await api.call("GET", f"/rl/v1/sessions/{sid}", key)).json()["status"] == "finalized"
    assert [t.reward for t in await api.trajectories(sid)] == [1.0]


async def test_double_finalize_writes_once(api: Api) -> None:
    session = await api.new_session()
    sid = session["session_id"]
    await api.add_completions(sid, 3)
    await api.call("POST", f"/rl/v1/sessions/{sid}/reward", session["api_key"], {"value": 1})
    await api.call("POST", f"/rl/v1/sessions/{sid}/end", session["api_key"])
    finalizer = api.services.finalizer
    assert finalizer is not None
    results = await asyncio.gather(finalizer.finalize(sid), finalizer.finalize(sid))
    await api.settle()
    assert await finalizer.finalize(sid) == 0
    assert sum(results) in (0, 1)  # the end may have finalized it already
    assert len(await api.trajectories(sid)) == 1  # three chained turns: one conversation trajectory


async def test_areal_aliases(api: Api) -> None:
    started = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "gsm8k-7"})
    assert started.status_code == 200 and set(started.json()) == {"session_id", "api_key"}
    sid, key = started.json()["session_id"], started.json()["api_key"]

    no_calls = await api.call("POST", "/rl/set_reward", key, {"reward": 1.0})
    assert_openai_error(no_calls, 400, "no_interactions")
    first, _last = await api.add_completions(sid, 2)
    assert_openai_error(await api.call("POST", "/rl/set_reward", key, {"reward": "x"}), 422)
    on_first = await api.call("POST", "/rl/set_reward", key, {"reward": 0.25, "interaction_id": first})
    assert on_first.json() == {"message": "success"}
    on_last = await api.call("POST", "/rl/set_reward", key, {"reward": 1, "interaction_id": None})
    assert on_last.status_code == 200
    assert_openai_error(await api.call("POST", "/rl/set_reward", api.admin_key, {"reward": 1}), 403)

    ended = await api.call("POST", "/rl/end_session", key, {})
    assert ended.json() == {"message": "success", "interaction_count": 2}
    await api.settle()
    # The last completion got the 1; the chain's one trajectory sums its rewards.
    assert [t.reward for t in await api.trajectories(sid)] == [1.25]

    group = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "t", "group_size": 3})
    assert group.status_code == 201
    assert set(group.json()) == {"group_id", "sessions"} and len(group.json()["sessions"]) == 3
    assert all(set(s) == {"session_id", "session_api_key"} for s in group.json()["sessions"])


async def test_areal_key_reuse_ends_and_finalizes_the_old_session(api: Api) -> None:
    chosen = "client-chosen-key-0123456789-abcdefghijklmnop"
    start = {"task_id": "a", "api_key": chosen}
    first = (await api.call("POST", "/rl/start_session", api.admin_key, start)).json()
    assert first["api_key"] == chosen
    await api.add_completions(first["session_id"], 1)

    second = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "b", "api_key": chosen})
    assert second.status_code == 200 and second.json()["session_id"] != first["session_id"]
    old = (await api.call("GET", f"/rl/v1/sessions/{first['session_id']}", api.admin_key)).json()
    assert old["status"] == "finalized"
    assert [t.reward for t in await api.trajectories(first["session_id"])] == [0.0]  # no reward: 0
    mine = await api.call("GET", f"/rl/v1/sessions/{second.json()['session_id']}", chosen)
    assert mine.status_code == 200 and mine.json()["status"] == "active"

    admin_as_session = await api.call("POST", "/rl/start_session", api.admin_key, {"api_key": api.admin_key})
    assert_openai_error(admin_as_session, 400)


async def test_areal_refuses_short_or_repetitive_client_chosen_keys(api: Api) -> None:
    before = await api.counts()
    for weak in ("client-chosen-key-0123456789", "k" * 40):
        body = {"task_id": "a", "api_key": weak}
        error = assert_openai_error(await api.call("POST", "/rl/start_session", api.admin_key, body), 400,
                                    "weak_api_key")
        assert error["param"] == "api_key" and "32 characters" in error["message"]
    assert await api.counts() == before

    chosen = secrets.token_urlsafe(32)
    started = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "a", "api_key": chosen})
    assert started.status_code == 200 and started.json()["api_key"] == chosen
    mine = await api.call("GET", f"/rl/v1/sessions/{started.json()['session_id']}", chosen)
    assert mine.status_code == 200


async def test_keys_are_listed_without_secrets_and_revoked_at_once_on_this_proxy(api: Api) -> None:
    session = await api.new_session()
    online_key = await create_online_key(api.services.session_factory, api.services.key_hasher)
    assert (await api.call("GET", "/rl/v1/policy", online_key)).status_code == 200  # now in the key cache

    assert_openai_error(await api.call("GET", "/rl/v1/keys", session["api_key"]), 403)
    listed = await api.call("GET", "/rl/v1/keys", api.admin_key)
    assert listed.status_code == 200 and listed.json()["object"] == "list"
    keys = listed.json()["data"]
    assert {k["kind"] for k in keys} == {"admin", "session", "online"}
    assert all(set(k) == {"id", "kind", "created_at", "revoked_at", "session_id"} for k in keys)
    for secret in (api.admin_key, online_key, session["api_key"]):
        assert secret not in listed.text and api.services.key_hasher.hash(secret) not in listed.text
    [online] = (await api.call("GET", "/rl/v1/keys?kind=online", api.admin_key)).json()["data"]
    assert online["revoked_at"] is None and online["session_id"] is None
    first = (await api.call("GET", "/rl/v1/keys?limit=1", api.admin_key)).json()
    assert len(first["data"]) == 1 and first["has_more"] is True

    before = await api.counts()
    path = f"/rl/v1/keys/{online['id']}/revoke"
    assert_openai_error(await api.call("POST", path, session["api_key"]), 403)
    for unknown in ("999999", "nope", "-1", "²"):
        missing = await api.call("POST", f"/rl/v1/keys/{unknown}/revoke", api.admin_key)
        assert_openai_error(missing, 404, "key_not_found")
    assert (await api.call("GET", "/rl/v1/policy", online_key)).status_code == 200
    revoked = await api.call("POST", path, api.admin_key)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert_openai_error(await api.call("GET", "/rl/v1/policy", online_key), 401, "invalid_api_key")  # at once
    again = await api.call("POST", path, api.admin_key)  # idempotent
    assert again.status_code == 200 and again.json() == revoked.json()
    assert await api.counts() == before


async def test_the_last_admin_key_cannot_be_revoked(api: Api) -> None:
    async def admin_ids() -> list[int]:
        listed = await api.call("GET", "/rl/v1/keys?kind=admin", api.admin_key)
        return [k["id"] for k in listed.json()["data"] if k["revoked_at"] is None]

    [mine] = await admin_ids()
    alone = await api.call("POST", f"/rl/v1/keys/{mine}/revoke", api.admin_key)
    assert_openai_error(alone, 409, "last_admin_key")
    assert (await api.call("GET", "/rl/v1/keys", api.admin_key)).status_code == 200  # still works

    other = await create_admin_key(api.services.session_factory, api.services.key_hasher)
    [other_id] = [i for i in await admin_ids() if i != mine]
    assert (await api.call("POST", f"/rl/v1/keys/{other_id}/revoke", api.admin_key)).status_code == 200
    assert_openai_error(await api.call("GET", "/rl/v1/keys", other), 401)
    assert_openai_error(await api.call("POST", f"/rl/v1/keys/{mine}/revoke", api.admin_key), 409)
    assert await admin_ids() == [mine]


async def test_a_revoked_client_chosen_key_is_not_reused(api: Api) -> None:
    chosen = secrets.token_hex(24)
    started = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "a", "api_key": chosen})
    assert started.status_code == 200
    listed = (await api.call("GET", "/rl/v1/keys?kind=session", api.admin_key)).json()["data"]
    [key_id] = [k["id"] for k in listed if k["session_id"] == started.json()["session_id"]]
    assert (await api.call("POST", f"/rl/v1/keys/{key_id}/revoke", api.admin_key)).status_code == 200

    before = await api.counts()
    reused = await api.call("POST", "/rl/start_session", api.admin_key, {"task_id": "b", "api_key": chosen})
    assert_openai_error(reused, 409, "key_revoked")
    assert_openai_error(await api.call("GET", f"/rl/v1/sessions/{started.json()['session_id']}", chosen), 401)
    assert await api.counts() == before
