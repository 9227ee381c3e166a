"""Reward hooks end to end in the proxy (in-process app, its hook runner and finalizer running) on SQLite and
Postgres: a session names its hooks at creation, ending it queues their jobs, the runner labels it, and the
finalizer writes its trajectories with the hooks' rewards. User graders in TRL, verl and AReaL shapes plug in
by name; failures are retried, then visible; group hooks label whole groups."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from aiohttp import web
from fastapi import FastAPI
from prometheus_client import generate_latest
from sqlalchemy import select

from proxy.app import create_proxy_app
from proxy.auth import create_admin_key
from proxy.config import ProxyConfig
from proxy.services import ProxyServices, build_services
from rewards.config import FinalizerConfig, HookRunnerConfig, RewardsConfig
from rewards.hooks.adapters import HookConfigError
from rewards.hooks.spec import HookSpec
from rewards.hooks.webhook import verify_signature
from serving.config import ServingConfig
from storage.models import Reward, Trajectory
from storage.queries import record_completions
from storage.records import CompletionRecord
from tests.support.databases import storage_config
from tests.support.proxy_harness import dead_worker_url

pytestmark = pytest.mark.slow

FUNCTIONS = "tests.support.reward_functions"


class Api:
    def __init__(self, app: FastAPI, client: httpx.AsyncClient, admin_key: str) -> None:
        self.app, self.client, self.admin_key = app, client, admin_key

    @property
    def services(self) -> ProxyServices:
        services: ProxyServices = self.app.state.services
        return services

    async def post(self, path: str, body: Any, key: str | None = None) -> httpx.Response:
        return await self.client.post(path, content=json.dumps(body),
                                      headers={"Authorization": f"Bearer {key or self.admin_key}",
                                               "Content-Type": "application/json"})

    async def session(self, **body: Any) -> dict[str, Any]:
        response = await self.post("/rl/v1/sessions", body)
        assert response.status_code == 201, response.text
        return dict(response.json())

    async def answer(self, session_id: str, *texts: str) -> list[str]:
        """One chat completion per text, chained, as the proxy records a multi-turn chat."""
        records: list[CompletionRecord] = []
        for i, text in enumerate(texts):
            records.append(CompletionRecord(
                id=f"chatcmpl-{session_id}-{i}", session_id=session_id,
                parent_id=records[-1].id if records else None, prompt_ids=[5 + i, 6 + i],
                output_ids=[10 + i, 11 + i], output_logprobs=np.full(2, -0.5, np.float32),
                output_versions=[0, 0],
                finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1,
                request_json={"messages": [{"role": "user", "content": f"question {i}"}]},
                response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]},
            ))
            await record_completions(self.services.session_factory, [records[-1]])
        return [record.id for record in records]

    async def end(self, session: dict[str, Any]) -> None:
        response = await self.post(f"/rl/v1/sessions/{session['session_id']}/end", {}, session["api_key"])
        assert response.status_code == 200, response.text

    async def view(self, session: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.get(f"/rl/v1/sessions/{session['session_id']}",
                                         headers={"Authorization": f"Bearer {self.admin_key}"})
        assert response.status_code == 200, response.text
        return dict(response.json())

    async def finalized(self, session: dict[str, Any]) -> dict[str, Any]:
        """The session's view once it is finalized (hooks settled, trajectories written)."""
        async def done() -> dict[str, Any] | None:
            view = await self.view(session)
            return view if view["status"] == "finalized" else None
        return await eventually(done)

    async def trajectory_rewards(self, session_id: str) -> list[float]:
        async with self.services.session_factory() as db:
            rows = await db.execute(select(Trajectory.reward).where(Trajectory.session_id == session_id))
            return [float(value) for value in rows.scalars()]


async def eventually(probe: Callable[[], Awaitable[Any]], timeout_s: float = 90.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        found = await probe()
        if found is not None:
            return found
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def rewards_config(**runner: Any) -> RewardsConfig:
    settings = {"poll_interval_s": 0.05, "backoff_s": 0.05, "timeout_s": 30.0, **runner}
    return RewardsConfig(runner=HookRunnerConfig(**settings))


@pytest.fixture
async def api(db_url: str, tiny_model_dir: Path) -> AsyncIterator[Api]:
    config = ProxyConfig(finalizer=FinalizerConfig(sweep_interval_s=0.2, reward_grace_s=3600))
    serving = ServingConfig(model=str(tiny_model_dir), worker_urls=[dead_worker_url()])
    app = create_proxy_app(config, storage_config(db_url), serving, rewards_config())
    async with app.router.lifespan_context(app):
        services = app.state.services
        admin_key = await create_admin_key(services.session_factory, services.key_hasher)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield Api(app, client, admin_key)


async def test_a_named_hook_labels_the_session_and_its_trajectories(api: Api) -> None:
    right = await api.session(metadata={"answer": "42"}, reward={"hook": f"{FUNCTIONS}:native_answer",
                                                                 "name": "mine", "args": {"bonus": 0.5}})
    wrong = await api.session(metadata={"answer": "42"}, reward={"hook": f"{FUNCTIONS}:native_answer",
                                                                 "name": "mine"})
    await api.answer(right["session_id"], "thinking", "so it is 42")
    await api.answer(wrong["session_id"], "it is 41")
    for session in (right, wrong):
        await api.end(session)
    view = await api.finalized(right)
    hooks = [(h["source"], h["state"], h["attempts"]) for h in view["hooks"]]
    assert hooks == [("hook:mine", "done", 1)]
    rewards = [(r["source"], r["value"], r["completion_id"]) for r in view["rewards"]]
    assert rewards == [("hook:mine", 1.5, None)]
    assert view["rewards"][0]["details"] == {"raw": 1.5, "weight": 1.0}
    assert await api.trajectory_rewards(right["session_id"]) == [1.5]
    await api.finalized(wrong)
    assert await api.trajectory_rewards(wrong["session_id"]) == [0.0]


@pytest.mark.parametrize("function", ["trl_reward", "compute_score", "areal_reward_fn", "async_length"])
async def test_graders_in_their_own_shapes_plug_in_unchanged(api: Api, function: str) -> None:
    session = await api.session(metadata={"answer": "7"},
                                reward={"hook": f"{FUNCTIONS}:{function}", "name": "g"})
    await api.answer(session["session_id"], "the answer is 7")
    await api.end(session)
    view = await api.finalized(session)
    assert view["hooks"][0]["state"] == "done", view["hooks"]
    assert [r["value"] for r in view["rewards"]] == [1.0]


async def test_several_hooks_add_up_by_weight_and_a_rest_reward_wins(api: Api) -> None:
    hooks = [{"hook": f"{FUNCTIONS}:native_answer", "name": "a", "weight": 0.25},
             {"hook": f"{FUNCTIONS}:async_length", "name": "b", "weight": 2.0}]
    weighted = await api.session(metadata={"answer": "1"}, reward=hooks)
    overruled = await api.session(metadata={"answer": "1"}, reward=hooks)
    for session in (weighted, overruled):
        await api.answer(session["session_id"], "1")
    response = await api.post(f"/rl/v1/sessions/{overruled['session_id']}/reward", {"value": -3.0},
                              overruled["api_key"])
    assert response.status_code == 200, response.text
    for session in (weighted, overruled):
        await api.end(session)
    await api.finalized(weighted)
    assert await api.trajectory_rewards(weighted["session_id"]) == [0.25 * 1.0 + 2.0 * 1.0]
    view = await api.finalized(overruled)
    assert {r["source"] for r in view["rewards"]} == {"rest", "hook:a", "hook:b"}
    assert await api.trajectory_rewards(overruled["session_id"]) == [-3.0]


async def test_a_failing_hook_is_retried_then_marked_failed_and_the_session_follows_missing_reward(
    api: Api,
) -> None:
    session = await api.session(reward={"hook": f"{FUNCTIONS}:always_raises", "name": "broken",
                                        "max_attempts": 3})
    await api.answer(session["session_id"], "anything")
    await api.end(session)
    view = await api.finalized(session)
    [hook] = view["hooks"]
    assert (hook["state"], hook["attempts"], hook["max_attempts"]) == ("failed", 3, 3)
    assert "this grader is broken" in hook["error"]
    assert view["rewards"] == []
    assert await api.trajectory_rewards(session["session_id"]) == [0.0]  # missing_reward "zero"
    metrics = generate_latest(api.services.metrics.registry).decode()
    assert 'flywheel_reward_hook_failures_total{source="hook:broken"} 1.0' in metrics
    assert 'flywheel_reward_hook_runs_total{outcome="retry",source="hook:broken"} 2.0' in metrics


async def test_a_hanging_grader_is_killed_at_its_timeout(api: Api) -> None:
    session = await api.session(reward={"hook": f"{FUNCTIONS}:hangs", "name": "stuck", "timeout_s": 1.0,
                                        "max_attempts": 1})
    await api.answer(session["session_id"], "anything")
    await api.end(session)
    view = await api.finalized(session)
    assert view["hooks"][0]["state"] == "failed" and "timed out" in view["hooks"][0]["error"]
    # The pool still grades after a worker was killed.
    after = await api.session(metadata={"answer": "3"}, reward={"hook": f"{FUNCTIONS}:native_answer",
                                                               "name": "ok"})
    await api.answer(after["session_id"], "3")
    await api.end(after)
    assert [r["value"] for r in (await api.finalized(after))["rewards"]] == [1.0]


async def test_a_group_hook_labels_every_member_once_the_last_one_ends(api: Api) -> None:
    response = await api.post("/rl/v1/groups", {"size": 3, "reward": [],
                                                "group_reward": {"hook": f"{FUNCTIONS}:rank_by_length",
                                                                 "name": "rank"}})
    assert response.status_code == 201, response.text
    members = response.json()["sessions"]
    for member, text in zip(members, ["short", "the longest answer", "medium one"], strict=True):
        await api.answer(member["session_id"], text)
    for member in members[:2]:
        await api.end(member)
    await asyncio.sleep(0.5)
    assert (await api.view(members[0]))["hooks"] == []  # the group has a member still active
    assert (await api.view(members[0]))["status"] == "ended"  # and is not trainable before its hook ran
    await api.end(members[2])
    views = [await api.finalized(member) for member in members]
    assert [[r["value"] for r in view["rewards"]] for view in views] == [[0.0], [1.0], [0.0]]
    assert all(v["hooks"][0]["level"] == "group" and v["hooks"][0]["state"] == "done" for v in views)


async def test_an_unknown_or_misconfigured_hook_is_refused_at_creation(api: Api) -> None:
    before = await count_rewards(api)
    unknown = await api.post("/rl/v1/sessions", {"reward": {"hook": "mathh"}})
    assert unknown.status_code == 400 and "did you mean 'math'" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["code"] == "invalid_reward_hook"
    missing = await api.post("/rl/v1/sessions", {"reward": {"hook": f"{FUNCTIONS}:no_such_function"}})
    assert missing.status_code == 400 and "no attribute" in missing.json()["error"]["message"]
    wrong_level = await api.post("/rl/v1/groups", {"size": 2, "group_reward": {"hook": "math"}})
    assert wrong_level.status_code == 400 and "session" in wrong_level.json()["error"]["message"]
    bad_args = await api.post("/rl/v1/sessions", {"reward": {"hook": "math", "args": {"nope": 1}}})
    assert bad_args.status_code == 400 and "nope" in bad_args.json()["error"]["message"]
    assert await count_rewards(api) == before


async def count_rewards(api: Api) -> int:
    async with api.services.session_factory() as db:
        return len(list((await db.execute(select(Reward.id))).scalars()))


async def test_a_configured_hook_that_cannot_be_used_stops_the_proxy(
    db_url: str, tiny_model_dir: Path
) -> None:
    serving = ServingConfig(model=str(tiny_model_dir), worker_urls=[dead_worker_url()])
    rewards = RewardsConfig(hooks=[HookSpec(hook="math_verify")])
    with pytest.raises(HookConfigError, match="did you mean 'math'"):
        async with build_services(ProxyConfig(), storage_config(db_url), serving, rewards):
            pass


async def test_math_on_an_input_that_hangs_math_verify_fails_the_job_and_hangs_nothing(api: Api) -> None:
    hanging = await api.session(metadata={"answer": "1"}, reward={
        "hook": "math", "args": {"timeout_s": 2.0}, "max_attempts": 1})
    await api.answer(hanging["session_id"], "#### 9^{9^{9^{9^{9}}}}")
    await api.end(hanging)
    [hook] = (await api.finalized(hanging))["hooks"]
    assert hook["state"] == "failed" and "HookTimeoutError" in hook["error"]
    fine = await api.session(metadata={"answer": "0.5"}, reward={"hook": "math"})
    await api.answer(fine["session_id"], "so the answer is \\boxed{\\frac{1}{2}}")
    await api.end(fine)
    assert [r["value"] for r in (await api.finalized(fine))["rewards"]] == [1.0]


async def test_a_webhook_that_fails_twice_lands_exactly_one_reward(api: Api) -> None:
    seen: list[str] = []

    async def grade(request: web.Request) -> web.Response:
        body = await request.read()
        assert verify_signature("shh", body, request.headers["X-Flywheel-Timestamp"],
                                request.headers["X-Flywheel-Signature"])
        seen.append(request.headers["Idempotency-Key"])
        if len(seen) <= 2:
            return web.Response(status=503)
        return web.json_response({"reward": 0.75})

    app = web.Application()
    app.router.add_post("/grade", grade)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        session = await api.session(reward={"hook": "webhook", "args": {
            "url": f"http://127.0.0.1:{port}/grade", "secret": "shh", "backoff_s": 0.05}})
        await api.answer(session["session_id"], "anything")
        await api.end(session)
        view = await api.finalized(session)
    finally:
        await runner.cleanup()
    assert len(seen) == 3 and len(set(seen)) == 1
    assert [(r["source"], r["value"]) for r in view["rewards"]] == [("hook:webhook", 0.75)]
    assert await count_rewards(api) == 1
