"""The demo agent against the real proxy (uvicorn on loopback, SQLite and Postgres, its own hook runner)
in front of a scripted SGLang worker that "solves" each problem in a set way: right in the #### form,
right in words, or wrong. The proxy is configured with a default reward hook (`hook:configured`) that the
agent must never let label its sessions. The agent talks only HTTP (openai client + REST); this test
reads the database to check what it left: one group of G ended sessions per problem, each rewarded once
(by the `math` hook, or with grading "rest" by the agent's own REST reward), one completion per attempt,
eval sessions greedy, ended and unrewarded (and so never trained on with missing_reward=drop)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from integrations.gsm8k import cli
from integrations.gsm8k.agent import EVAL_METADATA, HOOK_SOURCE, REWARD_SOURCE, evaluate, rollout_group
from integrations.gsm8k.loop import LoopSettings, PolicyVersionWaiter, run_agent_loop
from integrations.gsm8k.problems import Problem, generate_problems
from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient
from integrations.gsm8k.scoring import reward
from rewards.config import HookRunnerConfig, RewardsConfig
from rewards.hooks.spec import HookSpec
from storage.engine import SessionFactory
from storage.models import Completion, Reward, Session, Trajectory
from tests.support import scripted_worker
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory, dead_worker_url, run_db
from tests.support.text_script import TextScript

FINALIZER = {"sweep_interval_s": 0.2, "reward_grace_s": 0.2, "missing_reward": "drop"}
MODES = ("right_hashes", "right_words", "wrong_hashes")
FORMAT_BONUS = 0.25
CONFIGURED_SOURCE = "hook:configured"
GRADINGS = ("hook", "rest")


def configured_rewards() -> RewardsConfig:
    """A proxy-wide default hook (on every session created without naming its own) and a brisk runner."""
    configured = HookSpec(hook="math", name="configured", args={"format_bonus": 0.5})
    return RewardsConfig(hooks=[configured], runner=HookRunnerConfig(poll_interval_s=0.05, backoff_s=0.05))


def scripted_answer(problem: Problem, mode: str) -> str:
    gold = int(problem.answer)
    if mode == "right_hashes":
        return f"Step by step: it is {gold}.\n#### {gold}"
    if mode == "right_words":
        return f"I count them all. The answer is {gold}."
    return f"I guess.\n#### {gold + 1}"


def solver(model_dir: Path, answers: dict[str, str]) -> TextScript:
    """Finds the question in the rendered prompt and spells out that question's scripted answer."""

    def reply(prompt: str) -> str:
        user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return answers.get(user.strip(), "no idea")

    return TextScript(model_dir, reply)


@pytest.fixture(name="problems")
def problems_fixture() -> list[Problem]:
    return generate_problems(6, seed=11)


@pytest.fixture(name="modes")
def modes_fixture(problems: list[Problem]) -> dict[str, str]:
    return {p.question: MODES[i % len(MODES)] for i, p in enumerate(problems)}


@pytest.fixture(name="proxy")
def proxy_fixture(
    proxies: ProxyFactory, servers: LoopThread, tiny_model_dir: Path, problems: list[Problem],
    modes: dict[str, str], monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Proxy]:
    answers = {p.question: scripted_answer(p, modes[p.question]) for p in problems}
    script = solver(tiny_model_dir, answers)
    monkeypatch.setattr(scripted_worker, "token_text", script.text)
    worker = servers.start_scripted(token_fn=script, eos_token_id=script.eos)
    yield proxies.start([worker.url], rewards=configured_rewards(), finalizer=FINALIZER)
    servers.call(worker.stop())


def expected_reward(problem: Problem, modes: dict[str, str], bonus: float = FORMAT_BONUS) -> float:
    return {"right_hashes": 1.0 + bonus, "right_words": 1.0, "wrong_hashes": bonus}[modes[problem.question]]


async def _rows(session_factory: SessionFactory) -> dict[str, Any]:
    async with session_factory() as db:
        return {
            "sessions": list((await db.execute(select(Session))).scalars()),
            "completions": list((await db.execute(select(Completion))).scalars()),
            "rewards": list((await db.execute(select(Reward))).scalars()),
            "trajectories": list((await db.execute(select(Trajectory))).scalars()),
        }


def rows(proxy: Proxy) -> dict[str, Any]:
    return run_db(proxy.db_url, _rows)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def hook_jobs(proxy: Proxy, session_id: str) -> list[dict[str, Any]]:
    """The reward hook jobs of a session, as GET /rl/v1/sessions/{id} shows them."""
    with RLClient(proxy.base_url, proxy.admin_key) as rl:
        return list(rl.session(session_id)["hooks"])


@pytest.mark.parametrize("grading", GRADINGS)
def test_rollout_groups_and_evaluation_leave_the_right_rows(
    proxy: Proxy, problems: list[Problem], modes: dict[str, str], grading: str
) -> None:
    group_size, train, held_out = 4, problems[:4], problems[4:]
    agent_kwargs = {"temperature": 0.9, "max_tokens": 48, "format_bonus": FORMAT_BONUS, "grading": grading}
    results = [rollout_group(proxy.base_url, proxy.admin_key, p, group_size, agent_kwargs) for p in train]

    for problem, result in zip(train, results, strict=True):
        mode = modes[problem.question]
        want_text = scripted_answer(problem, mode)
        assert [a.text for a in result.attempts] == [want_text] * group_size  # what the agent received
        assert [a.reward for a in result.attempts] == pytest.approx([expected_reward(problem, modes)] * 4)
        assert result.mean_reward == pytest.approx(reward(want_text, problem.answer, FORMAT_BONUS))
        assert all(a.correct == (mode != "wrong_hashes") for a in result.attempts)
        assert all(a.formatted == (mode != "right_words") for a in result.attempts)
        assert all(a.grading_error is None and a.error is None for a in result.attempts)
    before_eval = rows(proxy)
    assert len(before_eval["completions"]) == len(train) * group_size

    accuracy = evaluate(proxy.base_url, proxy.admin_key, held_out, {"max_tokens": 48}, concurrency=2)
    right = sum(modes[p.question] != "wrong_hashes" for p in held_out)
    assert (accuracy.correct, accuracy.total, accuracy.errors) == (right, len(held_out), 0)
    assert accuracy.accuracy == pytest.approx(right / len(held_out))

    found = rows(proxy)
    sessions = {s.id: s for s in found["sessions"]}
    rewards_by_session: dict[str | None, list[Reward]] = {}
    for row in found["rewards"]:
        rewards_by_session.setdefault(row.session_id, []).append(row)
    completions_by_session: dict[str, list[Completion]] = {}
    for completion in found["completions"]:
        completions_by_session.setdefault(completion.session_id, []).append(completion)

    assert len(found["completions"]) == len(train) * group_size + len(held_out)
    assert all(row.source != CONFIGURED_SOURCE for row in found["rewards"])  # the default hook never ran
    wanted_source = HOOK_SOURCE if grading == "hook" else REWARD_SOURCE
    assert {row.source for row in found["rewards"]} == {wanted_source}  # hook mode: the agent posts none
    for problem, result in zip(train, results, strict=True):
        members = [s for s in sessions.values() if s.group_id == result.group_id]
        assert sorted(s.id for s in members) == sorted(a.session_id for a in result.attempts)
        attempts = {a.session_id: a for a in result.attempts}
        for session in members:
            assert session.status in ("ended", "finalized") and session.ended_at is not None
            assert session.task == problem.task()
            (completion,) = completions_by_session[session.id]
            assert completion.temperature == pytest.approx(0.9)
            (row,) = rewards_by_session[session.id]
            assert row.completion_id is None
            assert row.value == pytest.approx(reward(attempts[session.id].text, problem.answer, FORMAT_BONUS))
            assert row.value == pytest.approx(attempts[session.id].reward)
            jobs = hook_jobs(proxy, session.id)
            if grading == "rest":
                assert row.details["gold"] == problem.answer and jobs == []
                continue
            assert [(j["source"], j["state"]) for j in jobs] == [(HOOK_SOURCE, "done")]
            assert row.details["gold"] == str(problem.answer) and row.details["weight"] == 1.0
            assert row.details["raw"] == pytest.approx(row.value)
            assert attempts[session.id].predicted == row.details["predicted"]

    eval_sessions = [s for s in sessions.values() if s.metadata_ == EVAL_METADATA]
    assert EVAL_METADATA == {"purpose": "eval", "missing_reward": "drop"}
    assert sorted(s.id for s in eval_sessions) == sorted(accuracy.session_ids)
    for session in eval_sessions:
        assert session.group_id is None and session.ended_at is not None
        assert session.id not in rewards_by_session
        assert hook_jobs(proxy, session.id) == []  # not even the configured hook labels them
        (completion,) = completions_by_session[session.id]
        assert completion.temperature == 0.0  # greedy

    # The finalizer (missing_reward=drop) trains on the rewarded attempts only.
    wait_until(lambda: all(s.status == "finalized" for s in rows(proxy)["sessions"]
                           if s.id in sessions and s.id != proxy.session_id))
    trajectories = rows(proxy)["trajectories"]
    assert sorted(t.session_id for t in trajectories) == sorted(
        a.session_id for r in results for a in r.attempts
    )
    by_session = {a.session_id: a.reward for r in results for a in r.attempts}
    assert all(t.reward == pytest.approx(by_session[t.session_id]) for t in trajectories)


class JsonServer:
    """Answers every GET on loopback with `answer()` as JSON."""

    def __init__(self, answer: Callable[[], Any]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(answer()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.root = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class VersionServer(JsonServer):
    """Answers {"policy_version": v} on loopback; `v` is set by the test."""

    def __init__(self) -> None:
        self.version = 3
        super().__init__(lambda: {"policy_version": self.version})
        self.url = f"{self.root}/version"


def test_loop_waits_for_the_policy_version_between_rounds(proxy: Proxy, problems: list[Problem]) -> None:
    versions = VersionServer()
    try:
        waiter = PolicyVersionWaiter(versions.url, timeout_s=20, interval_s=0.05)
        asked: list[int] = []
        rounds_seen: list[int] = []

        def wait_for_version(advances: int) -> None:
            asked.append(advances)
            assert len(rounds_seen) == advances  # called after round `advances`, before the next
            versions.version = waiter.start + advances  # the "trainer" finishes its step
            waiter(advances)

        loop = LoopSettings(steps=3, group_size=2, problems_per_step=2, concurrency=3)
        report = run_agent_loop(
            proxy.base_url, proxy.admin_key, problems[:4], problems[4:], loop,
            wait_for_version=wait_for_version, on_round=lambda r: rounds_seen.append(r.round),
        )
        assert asked == [1, 2, 3] and rounds_seen == [1, 2, 3]
        assert [len(r.group_ids) for r in report.rounds] == [2, 2, 2]
        counts = report.counts()
        assert counts == {"rounds": 3, "groups": 6, "train_sessions": 12, "rewarded_sessions": 12,
                          "failed_attempts": 0, "eval_sessions": 4}

        waiter_that_times_out = PolicyVersionWaiter(versions.url, timeout_s=0.2, interval_s=0.05)
        with pytest.raises(TimeoutError, match="policy version stayed at"):
            waiter_that_times_out(1)
    finally:
        versions.close()
    assert len(proxy.completions()) == 12 + 2 * 2  # 3 rounds × 2 × 2, eval before and after


@pytest.mark.parametrize("grading", GRADINGS)
def test_cli_runs_rounds_and_writes_its_report(
    proxy: Proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str], grading: str
) -> None:
    out = tmp_path / "report"
    code = cli.main([
        "--base-url", proxy.v1, "--api-key", proxy.admin_key, "--steps", "2", "--group-size", "3",
        "--problems-per-step", "2", "--eval-problems", "3", "--source", "generated",
        "--max-tokens", "32", "--concurrency", "4", "--out", str(out), "--progress",
        "--grading", grading, "--format-bonus", str(FORMAT_BONUS),
    ])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads((out / "agent_report.json").read_text())
    assert report["counts"] == {"rounds": 2, "groups": 4, "train_sessions": 12, "rewarded_sessions": 12,
                                "failed_attempts": 0, "eval_sessions": 6}
    assert len(report["mean_reward_per_round"]) == 2
    assert report["eval_before"]["total"] == report["eval_after"]["total"] == 3
    assert report["settings"]["source"] == "generated" and "api_key" not in json.dumps(report)
    assert proxy.admin_key not in json.dumps(report)
    assert "held-out accuracy:" in printed.out and "mean reward per round:" in printed.out
    assert "18/18" in printed.err and "reward=" in printed.err  # the bar: every call, the live reward
    assert len(proxy.completions()) == 12 + 6
    assert report["settings"]["grading"] == grading

    # Each round's mean reward is that of the rewards its sessions got: from the hook, or posted.
    found = rows(proxy)
    group_of = {s.id: s.group_id for s in found["sessions"]}
    wanted_source = HOOK_SOURCE if grading == "hook" else REWARD_SOURCE
    assert {row.source for row in found["rewards"]} == {wanted_source}
    for summary in report["rounds"]:
        values = [row.value for row in found["rewards"] if group_of[row.session_id] in summary["group_ids"]]
        assert len(values) == 6
        assert summary["mean_reward"] == pytest.approx(sum(values) / len(values))


def test_waiting_for_hooks_ends_when_they_settle_and_gives_up_with_a_clear_error() -> None:
    jobs = [{"source": HOOK_SOURCE, "state": "done"}, {"source": "hook:slow", "state": "running"}]
    view = {"session_id": "s1", "rewards": [], "hooks": jobs}
    server = JsonServer(lambda: view)
    try:
        with RLClient(server.root, "sk-admin") as rl:
            assert rl.wait_for_hooks("s1", 5.0, sources=[HOOK_SOURCE]) == view  # only the math hook
            with pytest.raises(FlywheelAPIError, match=r"did not finish in 0.3 s \(hook:slow: running\)"):
                rl.wait_for_hooks("s1", 0.3, interval_s=0.05)
            jobs[1]["state"] = "failed"
            assert rl.wait_for_hooks("s1", 5.0)["hooks"] == jobs
    finally:
        server.close()


def test_cli_says_what_is_wrong_with_a_bad_key_or_url(
    proxy: Proxy, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    common = ["--steps", "1", "--group-size", "2", "--problems-per-step", "1", "--eval-problems", "0",
              "--source", "generated", "--out", str(tmp_path)]
    assert cli.main(["--base-url", proxy.base_url, "--api-key", "sk-wrong", *common]) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "Incorrect API key provided" in err and "check the API key" in err

    assert cli.main(["--base-url", proxy.base_url, "--api-key", proxy.session_key, *common]) == 1
    assert "HTTP 403" in capsys.readouterr().err  # a session key cannot create groups

    assert cli.main(["--base-url", dead_worker_url(), "--api-key", proxy.admin_key, *common]) == 1
    assert "cannot reach the Flywheel proxy" in capsys.readouterr().err
    assert not (tmp_path / "agent_report.json").exists()


def test_the_agent_imports_nothing_of_flywheels_services() -> None:
    forbidden = ("proxy", "storage", "trainer", "serving", "rewards", "flywheel")
    code = (
        "import sys, integrations.gsm8k.cli, integrations.gsm8k.__main__\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
