"""The whole loop as users run it: `flywheel up`'s processes (CPU engine, proxy, Ray trainer) on loopback,
an agent that only knows base_url + api_key (the real `openai` client) and REST rewards, on SQLite and
Postgres. The trainer must take at least 3 steps and the agent must see the new weights; the trainer's
/metrics answers where `flywheel up` said, its TensorBoard files hold every step, and the proxy's /metrics
the policy version it served."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from sqlalchemy import select
from transformers import AutoTokenizer

from storage.config import StorageConfig
from storage.engine import create_engine, create_sessionmaker
from storage.models import Completion, PolicyVersion, TrainStep
from tests.support.metrics_readers import tensorboard_scalars, try_scrape, value
from tests.support.stack import rest, running_stack, stack_overrides, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3


def engine_version(worker_url: str) -> str:
    return httpx.get(f"{worker_url}/model_info", timeout=10).json()["weight_version"]


def play_group(root_url: str, admin_key: str, received: dict[str, str], size: int = 2) -> None:
    """One group: each session chats once with its own key, is rewarded over REST and ended."""
    with rest(root_url, admin_key) as admin:
        group = admin.post("/rl/v1/groups", json={"size": size, "task": "say something"})
        assert group.status_code == 201, group.text
    for index, session in enumerate(group.json()["sessions"]):
        client = openai.OpenAI(base_url=f"{root_url}/v1", api_key=session["api_key"], max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Count to {index + 3}."}], max_tokens=12
        )
        received[answer.id] = answer.choices[0].message.content or ""
        with rest(root_url, session["api_key"]) as own:
            reward = own.post(f"/rl/v1/sessions/{session['session_id']}/reward", json={"value": index})
            assert reward.status_code == 200, reward.text
            assert own.post(f"/rl/v1/sessions/{session['session_id']}/end").status_code == 200


async def read_rows(db_url: str) -> tuple[list[Completion], list[int], list[TrainStep]]:
    engine = create_engine(StorageConfig(url=db_url))
    try:
        async with create_sessionmaker(engine)() as session:
            completions = list((await session.scalars(select(Completion))).all())
            versions = list((await session.scalars(select(PolicyVersion.version))).all())
            steps = list((await session.scalars(select(TrainStep).order_by(TrainStep.step))).all())
        return completions, versions, steps
    finally:
        await engine.dispose()


def test_agent_traffic_trains_the_served_policy(empty_db_url, tiny_model_dir, tmp_path):
    overrides = stack_overrides(
        empty_db_url, tiny_model_dir, tmp_path / "run",
        **{"trainer.batch_size": 2, "trainer.total_steps": STEPS, "trainer.lr": 1e-3,
           "trainer.max_head_offpolicyness": 1},
    )
    received: dict[str, str] = {}
    with running_stack(overrides) as stack:
        worker_url = next(o.split("=", 1)[1] for o in overrides if o.startswith("serving.port="))
        worker_url = f"http://127.0.0.1:{worker_url}"
        assert engine_version(worker_url) == "default"
        # Before any group is played the trainer cannot finish: its /metrics is up, idle claims counting.
        trainer_metrics = stack.metrics["trainer"]
        idle = wait_for(lambda: try_scrape(trainer_metrics), 180, "the trainer's /metrics", stack)
        claims = "flywheel_trainer_claims_total"
        wait_for(lambda: (value(try_scrape(trainer_metrics) or idle, claims, result="empty") or 0)
                 > (value(idle, claims, result="empty") or 0), 180, "an empty claim counted", stack)
        assert value(idle, "flywheel_trainer_steps_total") == 0

        def trained_enough() -> bool:
            if engine_version(worker_url) == str(STEPS):
                return True
            play_group(stack.root_url, stack.admin_key, received)
            return False

        wait_for(trained_enough, 240, f"policy version {STEPS} on the engine", stack)
        play_group(stack.root_url, stack.admin_key, received)  # served by the newest weights
        last_ids = list(received)[-2:]
        with rest(stack.root_url, stack.admin_key) as admin:
            policy = admin.get("/rl/v1/policy").json()
            assert policy["policy_version"] == STEPS
            assert policy["newest"]["version"] == STEPS and policy["newest"]["status"] == "promoted"
        served = try_scrape(f"{stack.root_url}/metrics")
        assert served is not None and value(served, "flywheel_proxy_policy_version") == STEPS
        hook_runner = try_scrape(stack.metrics["rewards"])  # the hook runner `flywheel up` started
        assert hook_runner is not None and value(hook_runner, "flywheel_reward_hook_jobs_in_flight") == 0

    completions, versions, steps = asyncio.run(read_rows(empty_db_url))
    rewards = tensorboard_scalars(tmp_path / "run" / "tensorboard")["reward/mean"]
    assert [step for step, _ in rewards] == list(range(1, STEPS + 1))
    assert sorted(versions)[-STEPS:] == list(range(1, STEPS + 1))
    assert [step.policy_version for step in steps] == list(range(1, STEPS + 1))
    by_id = {row.id: row for row in completions}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert set(received) <= set(by_id), "a completion the agent received is missing from the database"
    for completion_id, text in received.items():
        row = by_id[completion_id]
        assert tokenizer.decode(row.output_ids.tolist(), skip_special_tokens=True) == text
        assert len(row.output_ids) == len(row.output_logprobs) == len(row.output_versions) > 0
    for completion_id in last_ids:
        assert set(by_id[completion_id].output_versions.tolist()) == {STEPS}
    first = min(by_id.values(), key=lambda row: row.created_at)
    assert set(first.output_versions.tolist()) == {0}
