"""`flywheel up --online` as a user runs it: engines, the eval engine, proxy, hook runner and Ray trainer as
processes on loopback. An agent chats on the online key the stack wrote, a person's feedback rewards the
answer, and the trainer's new version is evaluated on the eval worker and promoted before the serving
worker gets it. Without an eval set online mode refuses to start, naming what to set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from flywheel.stack import ONLINE_KEY_FILE
from tests.support.online_loop import write_eval_set
from tests.support.stack import rest, running_stack, stack_overrides, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_online_mode_evaluates_then_serves_a_version_trained_on_feedback(
    empty_db_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    overrides = stack_overrides(
        empty_db_url, tiny_model_dir, run_dir,
        **{
            "trainer.batch_size": 1,
            "trainer.lr": 1e-3,
            "trainer.promotion.margin": 1.0,  # any trained version passes: this test is about the wiring
            "online.eval.dataset": str(write_eval_set(tmp_path / "eval.jsonl")),
            "online.eval.hook": '{"hook": "tests.support.online_loop:target_reward"}',
            "online.eval.max_new_tokens": 8,
            "proxy.finalizer.reward_grace_s": 2,
        },
    )
    with running_stack(overrides, online=True) as stack:
        online_key = (run_dir / ONLINE_KEY_FILE).read_text().strip()
        assert online_key == stack.online_key and online_key.startswith("fw-online-")
        # The serving engine, then the eval engine on the next port, then proxy, hook runner and trainer.
        assert [c.name for c in stack.children] == ["engine-0", "engine-1", "proxy", "rewards", "trainer"]

        client = openai.OpenAI(base_url=f"{stack.root_url}/v1", api_key=online_key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=8
        )
        answer, session_id = raw.parse(), raw.headers["x-flywheel-session-id"]
        with rest(stack.root_url, online_key) as api:
            feedback = api.post("/rl/v1/feedback", json={"completion_id": answer.id, "thumbs": "up"})
            assert feedback.status_code == 201 and feedback.json()["state"] == "applied", feedback.text
            assert api.post(f"/rl/v1/sessions/{session_id}/end").status_code == 200

            def promoted() -> dict | None:  # type: ignore[type-arg]
                policy = api.get("/rl/v1/policy").json()
                return policy if policy["policy_version"] >= 1 else None

            policy = wait_for(promoted, 300, "a promoted version", stack)
        served = policy["served"]
        assert served["status"] == "promoted" and served["eval_score"] is not None
        assert served["parent_version"] == 0 and policy["best_version"] is not None
        port = int(next(a.split("=")[1] for a in overrides if a.startswith("serving.port=")))
        info = httpx.get(f"http://127.0.0.1:{port}/model_info", timeout=10).json()
        assert info["weight_version"] == str(policy["policy_version"])
        eval_info = httpx.get(f"http://127.0.0.1:{port + 1}/model_info", timeout=10).json()
        assert eval_info["weight_version"] == str(policy["policy_version"])  # evaluated there first


def test_online_mode_without_an_eval_set_refuses_to_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "up", "--online", f"run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "online.eval.dataset" in result.stderr and "online.eval.hook" in result.stderr
    assert "Traceback" not in result.stderr
