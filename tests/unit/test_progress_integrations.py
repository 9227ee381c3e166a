"""The integrations' bars (they may not import `flywheel`, so they call tqdm with its conventions): the
OpenClaw task driver's counts each task as its result comes, the Scaffolding example's each problem as its
rollout is read; both on stderr, never on stdout."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from integrations.gsm8k.rl_api import FlywheelAPIError
from integrations.openclaw.cli import TaskBar
from integrations.openclaw.driver import OpenClawCli, Task, TaskResult, run_tasks
from integrations.scaffoldings.cli import ProblemBar
from integrations.scaffoldings.gsm8k import finished_rollouts
from integrations.scaffoldings.trajectory import Rollout, Sample


class RefusingProxy:
    """An RLClient whose proxy serves a model but refuses to open sessions."""

    def served_model(self) -> str:
        return "m"

    def create_session(self, **_: Any) -> Any:
        raise FlywheelAPIError("no sessions today", 503)


def test_the_openclaw_bar_counts_each_task_as_its_result_comes(tmp_path: Path) -> None:
    shown = io.StringIO()
    bar = TaskBar(3, enabled=True, file=shown)
    seen: list[int] = []

    def on_result(result: TaskResult) -> None:
        bar(result)
        seen.append(bar.bar.n)

    tasks = [Task(str(i), f"task {i}") for i in range(3)]
    client: Any = RefusingProxy()
    results = run_tasks(client, OpenClawCli(), tasks, [], tmp_path, on_result=on_result)
    bar.close()
    assert [r.error for r in results] == ["no sessions today"] * 3
    assert seen == [1, 2, 3]  # one step per task, as each ends
    assert "openclaw tasks" in shown.getvalue() and "3/3" in shown.getvalue()


class Finished:
    """A ScaffoldingResult already finished with `rollout`."""

    def __init__(self, rollout: Rollout) -> None:
        self.outputs = [type("Output", (), {"rollout": rollout})()]

    def result(self) -> Finished:
        return self


def rollout(group: str, *rewards: float | None) -> Rollout:
    samples = [Sample(session_id=f"{group}-{i}", completion_id=None, text="#### 1", reward=reward)
               for i, reward in enumerate(rewards)]
    return Rollout(group_id=group, task={}, samples=samples, chosen=0, text="#### 1")


def test_the_scaffolding_bar_counts_each_problem_with_the_mean_reward() -> None:
    shown = io.StringIO()
    bar = ProblemBar(2, enabled=True, file=shown)
    rollouts = [rollout("g1", 1.0, 0.0), rollout("g2", 1.0, None)]
    assert finished_rollouts([Finished(r) for r in rollouts], bar) == rollouts
    bar.close()
    assert bar.bar.n == 2
    assert "2/2" in shown.getvalue() and "reward=0.667" in shown.getvalue()
