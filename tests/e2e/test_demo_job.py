"""The main job (`flywheel demo`) end to end as a user runs it, shrunk to the tiny model: the CLI starts
engine, proxy and trainer, the agent process plays rounds on problems from a GSM8K-format JSONL file
against them, and the report is written, naming where the problems came from."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from serving.threaded_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def write_gsm8k_jsonl(path):
    """Problems in GSM8K's own format: a question, and a worked answer ending `#### <number>`."""
    with path.open("w") as out:
        for i in range(80):
            a, b = 3 + i, 7 + 2 * i
            out.write(json.dumps({
                "question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
                "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
            }) + "\n")


def test_demo_runs_rounds_trains_and_reports(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    problems = tmp_path / "gsm8k_train.jsonl"
    write_gsm8k_jsonl(problems)
    command = [
        sys.executable, "-m", "flywheel.cli", "demo",
        f"serving.model={tiny_model_dir}", f"serving.port={free_port()}", f"proxy.port={free_port()}",
        f"run.dir={run_dir}", "demo.source=jsonl", f"demo.jsonl={problems}", "demo.steps=3",
        "demo.group_size=2", "demo.problems_per_step=2", "demo.eval_problems=4", "demo.max_tokens=16",
        "trainer.lr=1e-3", "proxy.finalizer.sweep_interval_s=0.5", "trainer.poll_interval_s=0.2",
    ]
    env = dict(os.environ, FLYWHEEL_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "held-out accuracy:" in result.stdout
    assert "starting the stack (cpu run: model" in result.stdout
    assert f"problems: GSM8K-format JSONL {problems} (6 train, 4 held-out)" in result.stdout
    assert "3 steps, policy version 3" in result.stdout

    report = run_dir / "report"
    metrics = json.loads((report / "metrics.json").read_text())
    assert [step["policy_version"] for step in metrics] == [1, 2, 3]
    assert all(0 < step["batch/trajectories"] <= 4 for step in metrics)  # at most one round: G x P
    with sqlite3.connect(run_dir / "flywheel.db") as db:
        trained_eval = db.execute(
            "SELECT count(*) FROM trajectories t JOIN sessions s ON t.session_id = s.id "
            "WHERE json_extract(s.metadata, '$.purpose') = 'eval'"
        ).fetchone()[0]
        eval_sessions = db.execute(
            "SELECT count(*) FROM sessions WHERE json_extract(metadata, '$.purpose') = 'eval'"
        ).fetchone()[0]
    assert eval_sessions == 8 and trained_eval == 0  # held-out sessions are never trained on
    agent = json.loads((report / "agent_report.json").read_text())
    assert len(agent["mean_reward_per_round"]) == 3
    assert (agent["settings"]["source"], agent["settings"]["jsonl"]) == ("jsonl", str(problems))
    assert agent["eval_before"]["total"] == agent["eval_after"]["total"] == 4
    assert (report / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
