"""The demo agent's training run: held-out accuracy before, then rounds of P problems × G attempts that
Flywheel's `math` reward hook grades (or, with grading "rest", that the agent rewards over REST; the
trainer learns from them), then held-out accuracy after; and a JSON report.

The trainer runs elsewhere. Between rounds an optional hook waits for its policy version to advance,
so that each round samples from a newer policy (`PolicyVersionWaiter` polls a URL for it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from integrations.gsm8k.agent import (
    AgentPool,
    AgentSettings,
    Attempt,
    EvalResult,
    GroupResult,
    evaluate_with,
    rollout_groups,
)
from integrations.gsm8k.problems import Problem
from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient

logger = logging.getLogger(__name__)

Phase = Literal["eval_before", "train", "eval_after"]
REPORT_NAME = "agent_report.json"


@dataclass(frozen=True)
class LoopSettings:
    """The shape of a run."""

    steps: int
    """Rounds of rollouts."""
    group_size: int
    """G: sessions (attempts) per problem; one group each."""
    problems_per_step: int
    """P: problems (groups) per round."""
    concurrency: int = 8
    """Most chat calls in flight at once."""
    version_lag: int = 0
    """With a version hook: how many rounds the agent may run ahead of the trainer (0: each round
    waits for the step trained on the round before it)."""

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "problems_per_step", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.version_lag < 0:
            raise ValueError(f"version_lag must be >= 0, got {self.version_lag}")


@dataclass(frozen=True)
class RoundResult:
    """One round's rollouts."""

    round: int
    mean_reward: float
    """Over the attempts that were rewarded (their chat call succeeded and, with grading "hook", the
    hook gave them a reward)."""
    correct_rate: float
    format_rate: float
    attempts: int
    failed: int
    """Attempts whose chat call failed."""
    seconds: float
    group_ids: list[str]
    ungraded: int = 0
    """Answered attempts the reward hook gave no reward (it failed, or had no opinion)."""


@dataclass
class AgentReport:
    """What `agent_report.json` holds."""

    settings: dict[str, Any]
    eval_before: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    wall_s: float = 0.0

    def counts(self) -> dict[str, int]:
        attempts = sum(r.attempts for r in self.rounds)
        failed = sum(r.failed for r in self.rounds)
        ungraded = sum(r.ungraded for r in self.rounds)
        evals = [e for e in (self.eval_before, self.eval_after) if e is not None]
        return {
            "rounds": len(self.rounds),
            "groups": sum(len(r.group_ids) for r in self.rounds),
            "train_sessions": attempts,
            "rewarded_sessions": attempts - failed - ungraded,
            "failed_attempts": failed,
            "eval_sessions": sum(int(e["total"]) for e in evals),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "eval_before": self.eval_before,
            "eval_after": self.eval_after,
            "rounds": [asdict(r) for r in self.rounds],
            "mean_reward_per_round": [r.mean_reward for r in self.rounds],
            "counts": self.counts(),
            "wall_s": self.wall_s,
        }

    def write(self, out_dir: str | Path) -> Path:
        path = Path(out_dir) / REPORT_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def round_problems(problems: Sequence[Problem], index: int, count: int) -> list[Problem]:
    """Round `index`'s problems: the next `count` of `problems`, cycling when they run out."""
    if not problems:
        raise ValueError("no training problems")
    return [problems[(index * count + i) % len(problems)] for i in range(count)]


def summarize_round(index: int, groups: Sequence[GroupResult], seconds: float) -> RoundResult:
    attempts = [a for g in groups for a in g.attempts]
    answered = [a for a in attempts if a.error is None]
    rewards = [a.reward for a in answered if a.reward is not None]
    if attempts and not answered:  # every call failed: the proxy or the model is broken, not the agent
        raise FlywheelAPIError(f"round {index + 1}: all {len(attempts)} chat calls failed; the first: "
                               f"{attempts[0].error}")
    share = (lambda n: n / len(answered)) if answered else (lambda n: 0.0)
    return RoundResult(
        round=index + 1, mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        correct_rate=share(sum(a.correct for a in answered)),
        format_rate=share(sum(a.formatted for a in answered)),
        attempts=len(attempts), failed=len(attempts) - len(answered), seconds=seconds,
        group_ids=[g.group_id for g in groups], ungraded=len(answered) - len(rewards),
    )


def run_agent_loop(
    base_url: str, admin_key: str, train_problems: Sequence[Problem], eval_problems: Sequence[Problem],
    loop: LoopSettings, agent: AgentSettings | None = None, *,
    wait_for_version: Callable[[int], None] | None = None,
    on_attempt: Callable[[Phase, Attempt], None] | None = None,
    on_round: Callable[[RoundResult], None] | None = None,
    report_settings: dict[str, Any] | None = None,
) -> AgentReport:
    """Evaluate, run `loop.steps` rounds, evaluate again. `agent` None: defaults for the served model.

    `wait_for_version(n)` must block until the policy is at least `n` versions newer than when the run
    began: it is called after round r with r - version_lag (skipped when < 1) and, before the final
    evaluation, with `steps`, so the after-accuracy is that of the policy trained on every round.
    """
    started = time.perf_counter()
    with RLClient(base_url, admin_key) as rl, AgentPool(loop.concurrency) as (executor, http_client):
        model = rl.served_model()  # fails fast, with the proxy's words, on a bad URL or key
        agent = agent or AgentSettings(model=model)
        report = AgentReport(settings={**(report_settings or {}), **asdict(loop),
                                       **{k: v for k, v in asdict(agent).items() if k != "system_prompt"}})

        def evaluation(phase: Phase) -> dict[str, Any] | None:
            if not eval_problems:
                return None
            callback = None if on_attempt is None else (lambda a: on_attempt(phase, a))
            result: EvalResult = evaluate_with(rl, eval_problems, agent, executor, http_client=http_client,
                                               on_attempt=callback)
            logger.info("%s: held-out accuracy %.3f (%d/%d)", phase, result.accuracy, result.correct,
                        result.total)
            return result.as_dict()

        report.eval_before = evaluation("eval_before")
        train_callback = None if on_attempt is None else (lambda a: on_attempt("train", a))
        for index in range(loop.steps):
            round_started = time.perf_counter()
            problems = round_problems(train_problems, index, loop.problems_per_step)
            groups = rollout_groups(rl, problems, loop.group_size, agent, executor,
                                    http_client=http_client, on_attempt=train_callback)
            result = summarize_round(index, groups, time.perf_counter() - round_started)
            report.rounds.append(result)
            logger.info("round %d: mean reward %.3f over %d attempts", result.round, result.mean_reward,
                        result.attempts)
            if on_round is not None:
                on_round(result)
            if wait_for_version is not None:
                target = loop.steps if index + 1 == loop.steps else index + 1 - loop.version_lag
                if target >= 1:
                    wait_for_version(target)
        report.eval_after = evaluation("eval_after")
    report.wall_s = time.perf_counter() - started
    return report


class PolicyVersionWaiter:
    """A `wait_for_version` hook: polls a URL answering `{"policy_version": int}` until the version has
    advanced by the asked number since this waiter was made."""

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout_s: float = 1800.0, interval_s: float = 1.0
    ) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.start = self.read()

    def read(self) -> int:
        try:
            response = httpx.get(self.url, headers=self.headers, timeout=30.0)
        except httpx.TransportError as error:
            raise FlywheelAPIError(f"cannot reach the policy version URL {self.url} ({error})") from error
        if response.status_code >= 400:
            raise FlywheelAPIError(f"GET {self.url}: HTTP {response.status_code}: {response.text[:300]}",
                                   response.status_code)
        body = response.json()
        version = body.get("policy_version") if isinstance(body, dict) else None
        if not isinstance(version, int):
            raise FlywheelAPIError(f"GET {self.url} gave {body!r}; expected {{\"policy_version\": <int>}}")
        return version

    def __call__(self, advances: int) -> None:
        target = self.start + advances
        deadline = time.monotonic() + self.timeout_s
        version = self.read()
        while version < target:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the policy version stayed at {version} (waiting for {target}) for "
                    f"{self.timeout_s:.0f} s; "
                    "is the trainer running, and is its batch no larger than one round of sessions?"
                )
            time.sleep(self.interval_s)
            version = self.read()
        logger.info("policy version %d reached (wanted %d)", version, target)
