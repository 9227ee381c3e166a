"""`python -m integrations.gsm8k`: run the demo agent against a Flywheel proxy and write its report.

    python -m integrations.gsm8k --base-url http://127.0.0.1:8000 --api-key ADMIN_KEY \\
        --steps 20 --group-size 8 --problems-per-step 4 --eval-problems 50 --progress

Training attempts are graded by the proxy's `math` reward hook (`--grading hook`, the default) or scored
by the agent and rewarded over REST (`--grading rest`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

from integrations.gsm8k.agent import SYSTEM_PROMPT, AgentSettings, Attempt
from integrations.gsm8k.loop import (
    AgentReport,
    LoopSettings,
    Phase,
    PolicyVersionWaiter,
    RoundResult,
    run_agent_loop,
)
from integrations.gsm8k.problems import SOURCES, Problem, load_problems
from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient
from integrations.gsm8k.scoring import DEFAULT_FORMAT_BONUS

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""Held-out problems are drawn with their own seed (and, for generated and JSONL problems, from the
held-out hash split), so they never repeat the training problems."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m integrations.gsm8k",
        description="The Flywheel demo agent: solves math word problems through a Flywheel proxy with the "
                    "openai client; the proxy's math reward hook grades each attempt (or, with "
                    "--grading rest, the agent rewards it over the RL REST API).",
    )
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="the proxy's root (or its /v1) URL")
    add("--api-key", required=True, help="an admin key (`flywheel keys create --admin`)")
    add("--steps", type=int, default=10, help="rounds of rollouts")
    add("--group-size", type=int, default=8, help="G: attempts (sessions) per problem, one group")
    add("--problems-per-step", type=int, default=4, help="P: problems (groups) per round")
    add("--eval-problems", type=int, default=50,
        help="held-out problems evaluated before and after (0: none)")
    add("--source", choices=SOURCES, default="auto",
        help="auto: GSM8K from the Hub when reachable, else generated")
    add("--jsonl", help="a GSM8K-format JSONL file (with --source jsonl)")
    add("--eval-jsonl", help="a JSONL file of held-out problems; default: the held-out hash split of --jsonl")
    add("--difficulty", type=int, default=1, help="generated problems: 1 is mostly one step, small numbers")
    add("--seed", type=int, default=0)
    add("--model", help="model name sent with each call; default: the one the proxy serves")
    add("--temperature", type=float, default=1.0, help="sampling temperature of training attempts")
    add("--max-tokens", type=int, default=256)
    add("--format-bonus", type=float, default=DEFAULT_FORMAT_BONUS,
        help="reward added when the answer is written as '#### N'")
    add("--grading", choices=("hook", "rest"), default="hook",
        help="hook: each group names the proxy's `math` reward hook, which grades every attempt, and the "
             "agent reads the rewards back; rest: the agent scores each attempt and posts its reward")
    add("--hook-timeout", type=float, default=600.0,
        help="seconds to wait for the hook to grade one session (--grading hook)")
    add("--system-prompt", default=SYSTEM_PROMPT)
    add("--concurrency", type=int, default=8, help="most chat calls in flight at once")
    add("--version-url", help="URL answering {\"policy_version\": int} (Flywheel: <root>/rl/v1/policy; "
                              "sent with --api-key): wait for the trainer between rounds")
    add("--version-lag", type=int, default=0, help="rounds the agent may run ahead of the trainer")
    add("--version-timeout", type=float, default=1800.0, help="seconds to wait for one version advance")
    add("--out", default="gsm8k_report", help="directory for agent_report.json")
    add("--progress", action="store_true", help="show a progress bar with the live mean reward")
    add("--log-level", default="WARNING")
    return parser


def load_splits(args: argparse.Namespace) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems): disjoint, deterministic in --seed."""
    train_n = args.steps * args.problems_per_step
    train = load_problems(args.source, args.jsonl, "train", train_n, args.seed, args.difficulty)
    if args.eval_problems <= 0:
        return train, []
    eval_source, eval_path, hash_split = args.source, args.jsonl, True
    if args.eval_jsonl:
        eval_source, eval_path, hash_split = "jsonl", args.eval_jsonl, False
    elif args.source == "auto" and train and train[0].meta.get("source") != "gsm8k":
        eval_source = "generated"  # auto fell back: do not probe the Hub a second time
    held_out = load_problems(eval_source, eval_path, "test", args.eval_problems, args.seed + EVAL_SEED_OFFSET,
                             args.difficulty, hash_split=hash_split)
    return train, held_out


def data_settings(
    args: argparse.Namespace, train: Sequence[Problem], held_out: Sequence[Problem]
) -> dict[str, Any]:
    """The report's record of the data: the source each split really came from ("auto" resolved), the
    files read, and the counts."""
    source = train[0].meta.get("source", args.source) if train else args.source
    eval_source = held_out[0].meta.get("source", source) if held_out else source
    return {
        "source": source, "jsonl": str(args.jsonl) if source == "jsonl" else None,
        "eval_source": eval_source, "eval_jsonl": str(args.eval_jsonl) if args.eval_jsonl else None,
        "train_problems": len(train), "eval_problems": len(held_out), "seed": args.seed,
        "difficulty": args.difficulty,
    }


class ProgressBar:
    """A tqdm bar over every attempt, showing the phase and the current round's running mean reward."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, disable=not enabled, unit="call", dynamic_ncols=True)
        self._lock = threading.Lock()
        self._rewards: list[float] = []
        self._last_round: float | None = None

    def attempt(self, phase: Phase, attempt: Attempt) -> None:
        with self._lock:
            if phase == "train" and attempt.reward is not None:
                self._rewards.append(attempt.reward)
            postfix: dict[str, Any] = {"phase": phase}
            if self._rewards:
                postfix["reward"] = f"{sum(self._rewards) / len(self._rewards):.3f}"
            if self._last_round is not None:
                postfix["last_round"] = f"{self._last_round:.3f}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def round_done(self, result: RoundResult) -> None:
        with self._lock:
            self._rewards.clear()
            self._last_round = result.mean_reward

    def close(self) -> None:
        self._bar.close()


def summary(report: AgentReport, path: str) -> str:
    before, after = report.eval_before, report.eval_after
    lines = [f"report: {path}", f"problems: {data_source(report.settings)}"]
    if before is not None and after is not None:
        lines.append(f"held-out accuracy: {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
                     f"({before['correct']}/{before['total']} -> {after['correct']}/{after['total']})")
    rewards = ", ".join(f"{r.mean_reward:.3f}" for r in report.rounds)
    lines.append(f"mean reward per round: {rewards}")
    counts = report.counts()
    lines.append(f"sessions: {counts['train_sessions']} in {counts['groups']} groups, "
                 f"{counts['rewarded_sessions']} rewarded ({counts['failed_attempts']} failed calls), "
                 f"{counts['eval_sessions']} eval; "
                 f"{report.wall_s:.1f} s")
    return "\n".join(lines)


def data_source(settings: dict[str, Any]) -> str:
    """Where the run's problems came from, as the report says it: GSM8K from the Hub, which JSONL file,
    or the offline generator (the fallback when neither was given or reachable)."""
    names = {"gsm8k": "GSM8K (Hugging Face Hub)", "jsonl": "GSM8K-format JSONL", "generated": "generated "
             "GSM8K-style problems (offline fallback)"}
    text = names.get(settings.get("source", ""), str(settings.get("source")))
    if settings.get("jsonl"):
        text += f" {settings['jsonl']}"
    if settings.get("eval_source") not in (None, settings.get("source")) or settings.get("eval_jsonl"):
        held_out = names.get(settings["eval_source"], settings["eval_source"])
        text += f"; held-out: {held_out} {settings.get('eval_jsonl') or ''}".rstrip()
    return f"{text} ({settings.get('train_problems')} train, {settings.get('eval_problems')} held-out)"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loop = LoopSettings(args.steps, args.group_size, args.problems_per_step, args.concurrency,
                            args.version_lag)
        with RLClient(args.base_url, args.api_key) as rl:  # fails fast on a bad URL or key
            model = rl.served_model()
        train, held_out = load_splits(args)
        agent = AgentSettings(model=args.model or model, temperature=args.temperature,
                              max_tokens=args.max_tokens, system_prompt=args.system_prompt,
                              format_bonus=args.format_bonus, grading=args.grading,
                              hook_timeout_s=args.hook_timeout)
        waiter = None
        if args.version_url:
            waiter = PolicyVersionWaiter(args.version_url, api_key=args.api_key,
                                         timeout_s=args.version_timeout)
        total = 2 * len(held_out) + loop.steps * loop.problems_per_step * loop.group_size
        bar = ProgressBar(total, args.progress)
        try:
            report = run_agent_loop(
                args.base_url, args.api_key, train, held_out, loop, agent, wait_for_version=waiter,
                on_attempt=bar.attempt, on_round=bar.round_done,
                report_settings=data_settings(args, train, held_out),
            )
        finally:
            bar.close()
    except (FlywheelAPIError, TimeoutError, ValueError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    path = report.write(args.out)
    print(summary(report, str(path)))
    return 0
