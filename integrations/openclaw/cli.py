"""`python -m integrations.openclaw`: run headless OpenClaw tasks as RL episodes, or judge the last answer
of an interactive OpenClaw chat.

    python -m integrations.openclaw tasks --base-url http://127.0.0.1:8000 --api-key ADMIN_KEY \\
        --tasks tasks.jsonl --openclaw .venv-agents/node/node_modules/.bin/openclaw --report report.json
    python -m integrations.openclaw feedback --base-url http://127.0.0.1:8000 --api-key ONLINE_KEY \\
        --thumbs up --comment "read the right file"

`tasks` prints one JSON line per task (session, final answer, tools used, reward) on stdout, and on a
terminal a bar over the tasks on stderr (`--no-progress`: none). `feedback` posts a judgement of the key's
newest completion (or `--completion-id`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient
from integrations.openclaw.driver import DEFAULT_HOOK, OpenClawCli, TaskResult, load_tasks, run_tasks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m integrations.openclaw", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    tasks = commands.add_parser("tasks", help="run headless tasks, one session each, graded by a hook")
    tasks.add_argument("--base-url", required=True, help="the proxy's URL")
    tasks.add_argument("--api-key", required=True, help="an admin key (it creates the sessions)")
    tasks.add_argument("--tasks", type=Path, required=True, help="JSON Lines: {id, prompt, answer, files}")
    tasks.add_argument("--openclaw", default="openclaw", help="the openclaw executable (default: on PATH)")
    tasks.add_argument("--hook", default=json.dumps(DEFAULT_HOOK),
                       help="the reward hook spec(s) grading each session, JSON (default: %(default)s)")
    tasks.add_argument("--timeout-s", type=float, default=600.0, help="per task")
    tasks.add_argument("--workdir", type=Path, default=None, help="where task workspaces go (a temp dir)")
    tasks.add_argument("--report", type=Path, default=None, help="also write the results here as JSON")
    tasks.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                       help="no bar over the tasks on stderr (default: one when stderr is a terminal)")
    feedback = commands.add_parser("feedback", help="judge a completion (default: the key's newest)")
    feedback.add_argument("--base-url", required=True)
    feedback.add_argument("--api-key", required=True, help="the online key the chat used")
    feedback.add_argument("--completion-id", default=None)
    judgement = feedback.add_mutually_exclusive_group()
    judgement.add_argument("--value", type=float, default=None, help="the reward it gives")
    judgement.add_argument("--thumbs", choices=["up", "down"], default=None)
    feedback.add_argument("--comment", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "tasks":
            return _tasks(args)
        return _feedback(args)
    except (FlywheelAPIError, ValueError, FileNotFoundError) as exc:
        print(f"openclaw: {exc}", file=sys.stderr)
        return 1


def _tasks(args: argparse.Namespace) -> int:
    hooks = json.loads(args.hook)
    hooks = hooks if isinstance(hooks, list) else [hooks]
    tasks = load_tasks(args.tasks)
    cli = OpenClawCli(args.openclaw, args.timeout_s)
    bar = TaskBar(len(tasks), args.progress)
    try:
        with RLClient(args.base_url, args.api_key) as client, tempfile.TemporaryDirectory() as scratch:
            results = run_tasks(client, cli, tasks, hooks, args.workdir or Path(scratch), on_result=bar)
    finally:
        bar.close()
    for result in results:
        print(json.dumps(asdict(result)))
    if args.report is not None:
        args.report.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


class TaskBar:
    """A bar over the tasks on stderr (`enabled` None: only when stderr is a terminal), with how many
    succeeded and their mean reward; an `on_result` for `run_tasks`."""

    def __init__(self, total: int, enabled: bool | None, file: Any = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="openclaw tasks", unit="task", file=file or sys.stderr,
                        disable=None if enabled is None else not enabled, dynamic_ncols=True)
        self.ok = 0
        self.rewards: list[float] = []

    def __call__(self, result: TaskResult) -> None:
        self.ok += result.ok
        if result.reward is not None:
            self.rewards.append(result.reward)
        postfix: dict[str, Any] = {"ok": self.ok}
        if self.rewards:
            postfix["reward"] = f"{sum(self.rewards) / len(self.rewards):.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _feedback(args: argparse.Namespace) -> int:
    with RLClient(args.base_url, args.api_key) as client:
        answer = client.send_feedback(args.completion_id, value=args.value, thumbs=args.thumbs,
                                      comment=args.comment)
    print(json.dumps(answer))
    return 0
