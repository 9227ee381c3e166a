"""LLM judges that call the served model through our own proxy (a scripted worker speaks the tiny model's
tokens): the pointwise judge, group ranking in one call, and the next-state judge label the agent's sessions,
while the judges' own calls (one-off admin-key sessions) never become trajectories, get no hooks and are
never rewarded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from rewards.config import FinalizerConfig, HookRunnerConfig, RewardsConfig
from storage.models import RewardJob, Session, Trajectory
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script, run_db
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

pytestmark = pytest.mark.slow

KEY_ENV = "FLYWHEEL_TEST_JUDGE_KEY"


def reply(prompt: str) -> str:
    """What the served "model" says: a judge's verdicts when it is asked to judge, else the agent's answer."""
    if "grade the final answer" in prompt:
        return '{"score": 8, "reason": "correct and clear"}'
    if "Several AI assistants attempted the same task" in prompt:
        return '{"scores": {"A": 1.0, "B": 0.25}, "reason": "A explains more"}'
    if "judge of one turn" in prompt:
        return '{"verdict": "good", "reason": "the user moved on"}'
    return "The answer is 42."


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker, monkeypatch: pytest.MonkeyPatch) -> Proxy:
    runner = HookRunnerConfig(poll_interval_s=0.05, backoff_s=0.05, timeout_s=60)
    proxy = proxies.start([worker.url], RewardsConfig(runner=runner), health_check_interval_s=0,
                          finalizer=FinalizerConfig(sweep_interval_s=0.2, reward_grace_s=3600))
    monkeypatch.setenv(KEY_ENV, proxy.new_admin_key())  # the judges' key: calls on it are one-off sessions
    return proxy


def judge_args(proxy: Proxy, **extra: Any) -> dict[str, Any]:
    return {"base_url": proxy.v1, "api_key_env": KEY_ENV, "model": "served", **extra}


def rl(proxy: Proxy, method: str, path: str, body: Any = None, key: str | None = None) -> Any:
    response = httpx.request(method, f"{proxy.base_url}{path}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {key or proxy.admin_key}"})
    assert response.status_code < 300, response.text
    return response.json()


def chat(proxy: Proxy, key: str, *turns: str) -> None:
    """A conversation on the session key: each user turn, answered, then the next."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = proxy.client(key).chat.completions.create(model="served", messages=messages)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})


def finalized(proxy: Proxy, session_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = rl(proxy, "GET", f"/rl/v1/sessions/{session_id}")
        if view["status"] == "finalized":
            return view
        assert time.monotonic() < deadline, f"not finalized: {view['hooks']}"
        time.sleep(0.1)


async def _judge_sessions(session_factory: Any) -> list[tuple[str, Any]]:
    async with session_factory() as db:
        rows = await db.execute(select(Session.id, Session.reward_hooks)
                                .where(Session.metadata_["origin"].as_string() == "admin-call"))
        return [(row.id, row.reward_hooks) for row in rows]


async def _trajectory_sessions(session_factory: Any) -> set[str]:
    async with session_factory() as db:
        return set((await db.execute(select(Trajectory.session_id))).scalars())


async def _job_subjects(session_factory: Any) -> set[str | None]:
    async with session_factory() as db:
        return set((await db.execute(select(RewardJob.session_id))).scalars())


def assert_judges_left_no_training_data(proxy: Proxy, agent_sessions: set[str], judge_calls: int) -> None:
    """The judges made `judge_calls` calls, each a one-off session with no hooks and no trajectories."""
    judged = run_db(proxy.db_url, _judge_sessions)
    assert len(judged) == judge_calls
    assert all(hooks is None for _, hooks in judged)
    assert run_db(proxy.db_url, _trajectory_sessions) == agent_sessions
    assert run_db(proxy.db_url, _job_subjects) <= agent_sessions | {None}


def test_a_pointwise_judge_through_our_own_proxy(proxy: Proxy, script: TextScript) -> None:
    hook = {"hook": "judge", "args": judge_args(proxy, rubric="Is the answer 42?", samples=2)}
    session = rl(proxy, "POST", "/rl/v1/sessions", {"metadata": {"answer": "42"}, "reward": hook})
    chat(proxy, session["api_key"], "What is six times seven?")
    rl(proxy, "POST", f"/rl/v1/sessions/{session['session_id']}/end", {}, session["api_key"])
    view = finalized(proxy, session["session_id"])
    assert [(r["source"], r["value"]) for r in view["rewards"]] == [("hook:judge", 0.8)]
    [judged] = [p for p in script.prompts if "grade the final answer" in p]  # twice the same prompt
    assert "Is the answer 42?" in judged and "The answer is 42." in judged
    assert_judges_left_no_training_data(proxy, {session["session_id"]}, judge_calls=2)


def test_group_ranking_judges_a_whole_group_in_one_call(proxy: Proxy, script: TextScript) -> None:
    group = rl(proxy, "POST", "/rl/v1/groups", {
        "size": 2, "task": "What is six times seven?", "reward": [],
        "group_reward": {"hook": "group_ranking", "args": judge_args(proxy)},
    })
    for member in group["sessions"]:
        chat(proxy, member["api_key"], "What is six times seven?")
        rl(proxy, "POST", f"/rl/v1/sessions/{member['session_id']}/end", {}, member["api_key"])
    values = [[r["value"] for r in finalized(proxy, m["session_id"])["rewards"]] for m in group["sessions"]]
    assert values == [[1.0], [0.25]]
    assert sum("Several AI assistants attempted the same task" in p for p in script.prompts) == 1
    assert_judges_left_no_training_data(proxy, {m["session_id"] for m in group["sessions"]}, judge_calls=1)


def test_the_next_state_judge_rewards_each_turn_by_what_followed_it(proxy: Proxy, script: TextScript) -> None:
    hook = {"hook": "next_state", "args": judge_args(proxy, votes=3)}
    session = rl(proxy, "POST", "/rl/v1/sessions", {"reward": hook})
    chat(proxy, session["api_key"], "What is six times seven?", "Thanks, that is right!")
    rl(proxy, "POST", f"/rl/v1/sessions/{session['session_id']}/end", {}, session["api_key"])
    view = finalized(proxy, session["session_id"])
    first, last = (c["id"] for c in view["completions"])
    assert [(r["completion_id"], r["value"]) for r in view["rewards"]] == [(first, 1.0)]  # the last: none
    [judged] = [p for p in script.prompts if "judge of one turn" in p]  # three votes, one prompt
    assert "Thanks, that is right!" in judged
    assert last not in {r["completion_id"] for r in view["rewards"]}
    assert_judges_left_no_training_data(proxy, {session["session_id"]}, judge_calls=3)
