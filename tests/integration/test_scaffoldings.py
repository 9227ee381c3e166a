"""The Scaffolding example (`python -m integrations.scaffoldings`) against the real proxy (uvicorn on
loopback, SQLite and Postgres, its own hook runner): with each controller (plain, majority vote,
best-of-N) GSM8K problems from a JSONL file become one group per problem and one session per sample;
the rewards (the `math` hook's, or the example's own posted over REST) land on every session, and one
trainer step claims the trajectories carrying them. First on the CPU engine serving the tiny model, then
on a scripted worker whose answers are right, so the rewards and the chosen answers are known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integrations.gsm8k.agent import REWARD_SOURCE
from integrations.gsm8k.problems import Problem, generate_problems
from integrations.gsm8k.scoring import DEFAULT_FORMAT_BONUS
from integrations.scaffoldings import api, cli
from integrations.scaffoldings.compat.voting import best_index, majority_answer
from rewards.config import HookRunnerConfig, RewardsConfig
from rewards.hooks.spec import HookSpec
from serving.config import CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from tests.support import scripted_worker
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory
from tests.support.scaffoldings_stack import (
    session_views,
    train_one_step,
    trajectories,
    wait_finalized,
    write_gsm8k_jsonl,
)
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

FINALIZER = {"sweep_interval_s": 0.2, "reward_grace_s": 0.2, "missing_reward": "drop"}
CONFIGURED_SOURCE = "hook:configured"
HOOK_SOURCE = "hook:math"
PROBLEMS, SAMPLES = 2, 3
ENGINE_CASES = [("plain", "hook"), ("majority", "local"), ("best-of-n", "hook")]
SCRIPTED_CASES = [("plain", "local"), ("majority", "hook"), ("best-of-n", "local")]


def case_id(case: tuple[str, str]) -> str:
    return "-".join(case)


def configured_rewards() -> RewardsConfig:
    """A proxy-wide default hook, which sessions naming their own hooks (or none) must never get."""
    configured = HookSpec(hook="math", name="configured", args={"format_bonus": 0.5})
    return RewardsConfig(hooks=[configured], runner=HookRunnerConfig(poll_interval_s=0.05, backoff_s=0.05))


@pytest.fixture(name="problems")
def problems_fixture() -> list[Problem]:
    return generate_problems(PROBLEMS, seed=5)


@pytest.fixture(scope="module", name="engine_url")
def engine_url_fixture(tiny_model_dir: Path) -> Iterator[str]:
    config = ServingConfig(model=str(tiny_model_dir), cpu=CpuEngineConfig(num_threads=1))
    with serve_in_thread(create_engine_app(config, load_model(str(tiny_model_dir)))) as url:
        yield url


@pytest.fixture(name="pusher")
def pusher_fixture(servers: LoopThread) -> Iterator[ScriptedWorker]:
    """The worker the trainer step pushes its (stand-in) weights to."""
    worker = servers.start_scripted()
    yield worker
    servers.call(worker.stop())


def run_example(
    proxy: Proxy, data: Path, tmp_path: Path, controller: str, reward: str, *, max_tokens: int = 12,
    subprocess_run: bool = False, env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`python -m integrations.scaffoldings` (in a process of its own, or its `main` here); the report."""
    report = tmp_path / "report.json"
    argv = ["--base-url", proxy.base_url, "--api-key", proxy.admin_key, "--controller", controller,
            "--reward", reward, "--data", str(data), "--samples", str(SAMPLES),
            "--max-tokens", str(max_tokens), "--report", str(report)]
    if subprocess_run:
        done = subprocess.run([sys.executable, "-m", "integrations.scaffoldings", *argv], capture_output=True,
                              text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"report: {report}" in done.stdout
    else:
        assert cli.main(argv) == 0
    return json.loads(report.read_text())


def sessions_of(report: dict[str, Any]) -> list[str]:
    return [s["session_id"] for g in report["groups"] for s in g["samples"]]


def check_rewards_landed(proxy: Proxy, report: dict[str, Any], problems: list[Problem], reward: str) -> None:
    """Every sample is a session of its problem's group, with one completion and the reward the report
    shows, written by the hook or posted by the example (and never by the proxy's configured hook)."""
    assert report["problems"] == PROBLEMS and report["sessions"] == PROBLEMS * SAMPLES
    assert report["failed_calls"] == 0 and report["rewarded"] == PROBLEMS * SAMPLES
    assert len(set(sessions_of(report))) == PROBLEMS * SAMPLES
    views = session_views(proxy, sessions_of(report))
    source = HOOK_SOURCE if reward == "hook" else REWARD_SOURCE
    for problem, group in zip(problems, report["groups"], strict=True):
        assert group["gold"] == problem.answer and len(group["samples"]) == SAMPLES
        for sample in group["samples"]:
            view = views[sample["session_id"]]
            assert view["group_id"] == group["group_id"] and view["task"]["answer"] == problem.answer
            assert view["status"] in ("ended", "finalized")
            assert [c["id"] for c in view["completions"]] == [sample["completion_id"]]
            rows = [(r["source"], r["value"], r["completion_id"]) for r in view["rewards"]]
            assert rows == [(source, pytest.approx(sample["reward"]), None)]
            jobs = [(j["source"], j["state"]) for j in view["hooks"]]
            assert jobs == ([(HOOK_SOURCE, "done")] if reward == "hook" else [])
            assert view["rewards"][0]["details"]["gold"] == problem.answer


def check_choice(report: dict[str, Any], controller: str) -> None:
    """plain answers with its first sample, the vote with the first sample of the most frequent answer,
    best-of-N with the first sample of the highest reward."""
    for group in report["groups"]:
        samples, notes = group["samples"], group["controller"]
        if controller == "plain":
            assert group["chosen"] == 0 and notes == {}
        elif controller == "majority":
            assert notes["answers"] == [s["answer"] for s in samples]
            assert (group["chosen"], group["chosen_answer"]) == majority_answer(notes["answers"])
        else:
            assert notes["scores"] == pytest.approx([s["reward"] for s in samples])
            assert group["chosen"] == best_index([s["reward"] for s in samples])


def check_trained(proxy: Proxy, report: dict[str, Any], pusher: ScriptedWorker, tmp_path: Path) -> None:
    """Once finalized, one trainer step claims every trajectory, each with its session's reward and group."""
    ids = sessions_of(report)
    wait_finalized(proxy, ids)
    views = session_views(proxy, ids)
    ours = {tid: sid for tid, (sid, _) in trajectories(proxy.db_url).items() if sid in views}
    assert ours, "no sample became a trajectory"
    version, samples = train_one_step(proxy.db_url, pusher.url, len(ours), tmp_path)
    assert version == 1 and sorted(s.trajectory_id for s in samples) == sorted(ours)
    for sample in samples:
        view = views[ours[sample.trajectory_id]]
        assert sample.reward == pytest.approx(view["rewards"][0]["value"])
        assert sample.group_id == view["group_id"]
    assert {step for tid, (_, step) in trajectories(proxy.db_url).items() if tid in ours} == {1}


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the scripted cases cover Postgres
@pytest.mark.parametrize(("controller", "reward"), ENGINE_CASES, ids=map(case_id, ENGINE_CASES))
def test_each_controller_on_the_tiny_model_leaves_rewarded_groups_a_trainer_step_consumes(
    proxies: ProxyFactory, engine_url: str, pusher: ScriptedWorker, problems: list[Problem], tmp_path: Path,
    controller: str, reward: str,
) -> None:
    proxy = proxies.start([engine_url], rewards=configured_rewards(), finalizer=FINALIZER)
    data = write_gsm8k_jsonl(tmp_path / "gsm8k.jsonl", problems)
    report = run_example(proxy, data, tmp_path, controller, reward, subprocess_run=controller == "plain")
    assert (report["backend"], report["controller"]) == (api.BACKEND, controller)
    assert report["reward"] == (HOOK_SOURCE if reward == "hook" else f"local:{REWARD_SOURCE}")
    check_rewards_landed(proxy, report, problems, reward)
    check_choice(report, controller)
    check_trained(proxy, report, pusher, tmp_path)


def right_answers(model_dir: Path, problems: list[Problem]) -> TextScript:
    answers = {p.question: f"Adding up, it is {p.answer}.\n#### {p.answer}" for p in problems}

    def reply(prompt: str) -> str:
        user = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return answers.get(user.strip(), "no idea")

    return TextScript(model_dir, reply)


@pytest.fixture(name="solver")
def solver_fixture(
    servers: LoopThread, tiny_model_dir: Path, problems: list[Problem], monkeypatch: pytest.MonkeyPatch
) -> Iterator[ScriptedWorker]:
    """A scripted worker answering each problem right, in GSM8K's `#### N` form."""
    script = right_answers(tiny_model_dir, problems)
    monkeypatch.setattr(scripted_worker, "token_text", script.text)
    worker = servers.start_scripted(token_fn=script, eos_token_id=script.eos)
    yield worker
    servers.call(worker.stop())


@pytest.mark.parametrize(("controller", "reward"), SCRIPTED_CASES, ids=map(case_id, SCRIPTED_CASES))
def test_right_answers_are_rewarded_and_chosen(
    proxies: ProxyFactory, solver: ScriptedWorker, pusher: ScriptedWorker, problems: list[Problem],
    tmp_path: Path, controller: str, reward: str,
) -> None:
    proxy = proxies.start([solver.url], rewards=configured_rewards(), finalizer=FINALIZER)
    data = write_gsm8k_jsonl(tmp_path / "gsm8k.jsonl", problems)
    report = run_example(proxy, data, tmp_path, controller, reward, max_tokens=40)
    best = 1.0 + DEFAULT_FORMAT_BONUS
    assert report["mean_reward"] == pytest.approx(best)
    assert report["sample_accuracy"] == report["chosen_accuracy"] == 1.0
    for problem, group in zip(problems, report["groups"], strict=True):
        assert (group["chosen"], group["chosen_answer"], group["correct"]) == (0, problem.answer, True)
        assert [s["answer"] for s in group["samples"]] == [problem.answer] * SAMPLES
    check_rewards_landed(proxy, report, problems, reward)
    check_trained(proxy, report, pusher, tmp_path)


def test_the_example_runs_unchanged_on_tensorrt_llm(
    request: pytest.FixtureRequest, db_url: str, problems: list[Problem], tmp_path: Path
) -> None:
    """The same CLI, forced onto `tensorrt_llm.scaffolding`; skipped where it is not installed (the
    proxy and engine are started only past the skip)."""
    if not api.tensorrt_llm_available():
        pytest.skip("tensorrt_llm is not installed: it needs CUDA")
    proxies: ProxyFactory = request.getfixturevalue("proxies")
    engine_url: str = request.getfixturevalue("engine_url")
    proxy = proxies.start([engine_url], rewards=configured_rewards(), finalizer=FINALIZER)
    data = write_gsm8k_jsonl(tmp_path / "gsm8k.jsonl", problems)
    env = {**os.environ, api.BACKEND_ENV: api.TENSORRT_LLM}
    report = run_example(proxy, data, tmp_path, "majority", "hook", subprocess_run=True, env=env)
    assert report["backend"] == api.TENSORRT_LLM
    check_rewards_landed(proxy, report, problems, "hook")
