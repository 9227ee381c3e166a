"""GSM8K RLVR with Scaffolding on Flywheel, three ways: a plain generation controller (G samples of each
problem, one group), majority voting (N samples, a vote on the extracted answer) and best-of-N (the
reward picks the best of N). In all three every sample is a session of the problem's group, so every
one is a training sample. `run` is what `python -m integrations.scaffoldings` calls."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from integrations.gsm8k.agent import REWARD_SOURCE, SYSTEM_PROMPT
from integrations.gsm8k.problems import Problem
from integrations.gsm8k.rl_api import RLClient
from integrations.gsm8k.scoring import DEFAULT_FORMAT_BONUS, extract_answer, is_correct, is_formatted, reward
from integrations.scaffoldings.api import BACKEND, NativeGenerationController, ScaffoldingLlm
from integrations.scaffoldings.controllers import FlywheelBestOfNController, FlywheelMajorityVoteController
from integrations.scaffoldings.reward_controller import FlywheelRewardController
from integrations.scaffoldings.trajectory import FlywheelTrajectoryMaker, Rollout, TaskFor
from integrations.scaffoldings.workers import flywheel_workers

CONTROLLERS = ("plain", "majority", "best-of-n")
REWARDS = ("hook", "local")


@dataclass(frozen=True)
class ExampleSettings:
    """How the example samples and rewards. `samples`: sessions per problem (G for plain, N for the
    vote and best-of-N). `reward`: "hook" names the proxy's `hook` reward hook on each group (the gold
    answer is in the group's task), "local" scores each answer here and posts it over REST."""

    controller: str = "plain"
    samples: int = 4
    reward: str = "hook"
    hook: str = "math"
    format_bonus: float = DEFAULT_FORMAT_BONUS
    temperature: float = 1.0
    max_tokens: int = 256
    system_prompt: str = SYSTEM_PROMPT
    concurrency: int = 8
    hook_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller must be one of {', '.join(CONTROLLERS)}, got {self.controller!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, got {self.reward!r}")
        if self.samples < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("samples, concurrency and max_tokens must be >= 1")


def gsm8k_reward(
    prompt: str, completion: str, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, answer: str,
    format_bonus: float = DEFAULT_FORMAT_BONUS, **task: Any,
) -> tuple[float, dict[str, Any]]:
    """A local reward function in AReaL's shape: 1 for the right final answer plus `format_bonus` for the
    `#### N` form (integrations.gsm8k.scoring), with what it found."""
    predicted = extract_answer(completion)
    details = {"predicted": predicted, "gold": answer, "correct": is_correct(predicted, answer),
               "formatted": is_formatted(completion)}
    return reward(completion, answer, format_bonus), details


def reward_controller(settings: ExampleSettings) -> FlywheelRewardController:
    if settings.reward == "hook":
        args = {"format_bonus": settings.format_bonus} if settings.hook == "math" else {}
        return FlywheelRewardController(hook={"hook": settings.hook, "args": args},
                                        hook_timeout_s=settings.hook_timeout_s)
    scorer = functools.partial(gsm8k_reward, format_bonus=settings.format_bonus)
    return FlywheelRewardController(reward_fn=scorer, source=REWARD_SOURCE)


def trajectory_maker(settings: ExampleSettings, task_for: TaskFor) -> FlywheelTrajectoryMaker:
    """The controller tree of `settings.controller`, under a trajectory maker."""
    generation = NativeGenerationController(
        sampling_params={"max_tokens": settings.max_tokens, "temperature": settings.temperature})
    rewards, n = reward_controller(settings), settings.samples
    if settings.controller == "plain":
        return FlywheelTrajectoryMaker(generation, rewards, task_for=task_for, rollouts=n)
    if settings.controller == "majority":
        controller: Any = FlywheelMajorityVoteController(generation, n, answer_of=extract_answer)
    else:
        controller = FlywheelBestOfNController(generation, reward_controller(settings), n)
    return FlywheelTrajectoryMaker(controller, rewards, task_for=task_for, samples_per_rollout=n,
                                   controller_kwargs={"sample_num": n})


def finished_rollouts(
    results: Sequence[Any], on_done: Callable[[Rollout], None] | None = None
) -> list[Rollout]:
    """Each request's rollout, waited for in order (`ScaffoldingResult.result()` raises the request's
    error), `on_done` told of each as it is read (the command's progress bar)."""
    rollouts = []
    for result in results:
        rollout = result.result().outputs[0].rollout
        rollouts.append(rollout)
        if on_done is not None:
            on_done(rollout)
    return rollouts


def run(
    base_url: str, admin_key: str, problems: Sequence[Problem], settings: ExampleSettings,
    model: str | None = None, on_done: Callable[[Rollout], None] | None = None,
) -> dict[str, Any]:
    """Run every problem through the example's controller on the proxy at `base_url`; the report.
    `on_done` is told of each problem's rollout as it finishes, in problem order."""
    started = time.monotonic()
    with RLClient(base_url, admin_key) as rl:  # fails fast on a bad URL or key
        model = model or rl.served_model()
    by_question = {p.question: p for p in problems}
    maker = trajectory_maker(settings, lambda prompt: by_question[prompt].task())
    llm = ScaffoldingLlm(maker, flywheel_workers(base_url, admin_key, model=model,
                                                 system_prompt=settings.system_prompt))
    llm.max_parallel_requests = settings.concurrency
    try:
        rollouts = finished_rollouts([llm.generate_async(p.question) for p in problems], on_done)
    finally:
        llm.shutdown()
    return report(settings, problems, rollouts, time.monotonic() - started, model)


def group_report(problem: Problem, rollout: Rollout) -> dict[str, Any]:
    chosen_answer = None if rollout.text is None else extract_answer(rollout.text)
    samples = [{"session_id": s.session_id, "completion_id": s.completion_id,
                "answer": None if s.text is None else extract_answer(s.text), "reward": s.reward,
                "error": s.error} for s in rollout.samples]
    return {"problem_id": problem.id, "gold": problem.answer, "group_id": rollout.group_id,
            "chosen": rollout.chosen, "chosen_answer": chosen_answer,
            "correct": is_correct(chosen_answer, problem.answer), "controller": rollout.controller,
            "samples": samples}


def report(
    settings: ExampleSettings, problems: Sequence[Problem], rollouts: Sequence[Rollout], wall_s: float,
    model: str,
) -> dict[str, Any]:
    """The run's JSON report: settings, totals and one entry per group."""
    groups = [group_report(p, r) for p, r in zip(problems, rollouts, strict=True)]
    samples = [s for g in groups for s in g["samples"]]
    rewards = [s["reward"] for s in samples if s["reward"] is not None]
    right = [is_correct(s["answer"], g["gold"]) for g in groups for s in g["samples"]]
    return {
        "backend": BACKEND, "model": model, "controller": settings.controller, "samples": settings.samples,
        "reward": reward_controller(settings).describe(), "problems": len(groups),
        "sessions": len(samples), "rewarded": len(rewards),
        "failed_calls": sum(s["error"] is not None for s in samples),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "sample_accuracy": sum(right) / len(right) if right else None,
        "chosen_accuracy": sum(g["correct"] for g in groups) / len(groups) if groups else None,
        "wall_s": round(wall_s, 3), "groups": groups,
    }
