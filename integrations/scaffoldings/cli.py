"""`python -m integrations.scaffoldings`: GSM8K problems through a Scaffolding controller on a Flywheel
proxy, every sample a session of its problem's group; writes a JSON report.

    python -m integrations.scaffoldings --base-url http://127.0.0.1:8000 --api-key ADMIN_KEY \\
        --controller majority --samples 4 --data gsm8k_test.jsonl --problems 20

On a terminal a bar over the problems shows on stderr (`--no-progress`: none).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from integrations.gsm8k.agent import SYSTEM_PROMPT
from integrations.gsm8k.problems import Problem, generate_problems, load_jsonl
from integrations.gsm8k.rl_api import FlywheelAPIError
from integrations.gsm8k.scoring import DEFAULT_FORMAT_BONUS
from integrations.scaffoldings.gsm8k import CONTROLLERS, REWARDS, ExampleSettings, run
from integrations.scaffoldings.trajectory import Rollout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m integrations.scaffoldings",
        description="GSM8K RLVR with a Scaffolding controller (plain, majority vote, best-of-N) on a "
                    "Flywheel proxy: one group per problem, one session per sample, rewards by the proxy's "
                    "reward hook or computed here and posted over REST.",
    )
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="the proxy's root (or its /v1) URL")
    add("--api-key", required=True,
        help="an admin key (`flywheel keys create --admin`, or <run dir>/admin_key)")
    add("--controller", choices=CONTROLLERS, default="plain")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="a GSM8K-format JSONL file of {question, answer: '... #### N'} rows")
    data.add_argument("--generated", type=int, metavar="N", help="N generated GSM8K-style problems instead")
    add("--problems", type=int, help="use only the first N problems of --data")
    add("--samples", type=int, default=4, help="sessions per problem: G (plain) or N (vote, best-of-N)")
    add("--reward", choices=REWARDS, default="hook",
        help="hook: the proxy's reward hook grades each ended session; local: scored here, posted over REST")
    add("--hook", default="math", help="the reward hook to name (--reward hook)")
    add("--format-bonus", type=float, default=DEFAULT_FORMAT_BONUS, help="reward for a '#### N' answer")
    add("--temperature", type=float, default=1.0)
    add("--max-tokens", type=int, default=256)
    add("--system-prompt", default=SYSTEM_PROMPT)
    add("--model", help="model name sent with each call; default: the one the proxy serves")
    add("--concurrency", type=int, default=8, help="problems in flight at once")
    add("--hook-timeout", type=float, default=600.0, help="seconds to wait for a hook to grade a session")
    add("--report", default="scaffolding_report.json", help="where to write the JSON report")
    add("--log-level", default="WARNING")
    add("--no-progress", dest="progress", action="store_false", default=None,
        help="no bar over the problems on stderr (default: one when stderr is a terminal)")
    return parser


def load(args: argparse.Namespace) -> list[Problem]:
    if args.generated is not None:
        return generate_problems(args.generated, seed=0)
    problems = load_jsonl(args.data)
    return problems if args.problems is None else problems[: args.problems]


class ProblemBar:
    """A bar over the problems on stderr (`enabled` None: only when stderr is a terminal), with the mean
    reward of the samples so far; an `on_done` for `run`."""

    def __init__(self, total: int, enabled: bool | None, file: Any = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="problems", unit="problem", file=file or sys.stderr,
                        disable=None if enabled is None else not enabled, dynamic_ncols=True)
        self.rewards: list[float] = []

    def __call__(self, rollout: Rollout) -> None:
        self.rewards += [s.reward for s in rollout.samples if s.reward is not None]
        if self.rewards:
            self.bar.set_postfix(reward=f"{sum(self.rewards) / len(self.rewards):.3f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ExampleSettings(
            controller=args.controller, samples=args.samples, reward=args.reward, hook=args.hook,
            format_bonus=args.format_bonus, temperature=args.temperature, max_tokens=args.max_tokens,
            system_prompt=args.system_prompt, concurrency=args.concurrency, hook_timeout_s=args.hook_timeout)
        problems = load(args)
        if not problems:
            raise ValueError("no problems to run")
        bar = ProblemBar(len(problems), args.progress)
        try:
            result = run(args.base_url, args.api_key, problems, settings, model=args.model, on_done=bar)
        finally:
            bar.close()
    except (FlywheelAPIError, ValueError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    path = Path(args.report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    mean = "n/a" if result["mean_reward"] is None else f"{result['mean_reward']:.3f}"
    print(f"report: {path}\n{result['controller']} on {result['backend']}: {result['problems']} problems, "
          f"{result['sessions']} sessions, {result['rewarded']} rewarded, mean reward {mean}, "
          f"chosen accuracy {result['chosen_accuracy']:.3f}")
    return 0
