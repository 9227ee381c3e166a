"""Reward functions in the shapes users already have, named by `module:function` in hook specs. They run in
the hook runner's spawned worker processes, so they live in an importable module, not in a test file."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rewards.hooks.contract import GroupInput, SessionInput


def _matches(text: str, answer: Any) -> bool:
    return answer is not None and text.strip().endswith(str(answer))


def native_answer(session: SessionInput, bonus: float = 0.0) -> float:
    """This project's own shape: 1 when the final answer ends with the expected answer."""
    return (1.0 if _matches(session.answer_text, session.expected("answer")) else 0.0) + bonus


def trl_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
               **kwargs: Any) -> list[float | None]:
    """TRL's reward function: conversational completions, the dataset's columns as keyword lists."""
    answers = kwargs["answer"]
    assert len(prompts) == len(completions) == len(completion_ids) == len(answers)
    return [1.0 if _matches(c[0]["content"], a) else 0.0 for c, a in zip(completions, answers, strict=True)]


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> dict[str, Any]:
    """verl's compute_score: a dict with "score" and extras."""
    return {"score": 1.0 if _matches(solution_str, ground_truth) else 0.0, "source_seen": data_source}


def areal_reward_fn(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
                    answer: str, **kwargs: Any) -> float:
    """AReaL's reward_fn: prompt and completion text, their token ids, the dataset row's fields."""
    assert isinstance(prompt, str) and prompt_ids and completion_ids
    return 1.0 if _matches(completions, answer) else 0.0


async def async_length(session: SessionInput) -> float:
    """An async hook: runs on the runner's event loop."""
    return float(len(session.completions))


def rank_by_length(group: GroupInput) -> list[float]:
    """A group hook: the longest final answer gets 1, the others 0."""
    lengths = [len(session.answer_text) for session in group.sessions]
    return [1.0 if length == max(lengths) else 0.0 for length in lengths]


def always_raises(session: SessionInput) -> float:
    raise RuntimeError("this grader is broken")


def hangs(session: SessionInput) -> float:
    """A grader stuck in a loop that SIGALRM in a thread could never stop."""
    while True:
        time.sleep(0.05)


def slow_marked(session: SessionInput, seconds: float = 1.0) -> float:
    """Sleeps, then appends the session id to the file in $FLYWHEEL_TEST_HOOK_LOG (each run leaves a line)."""
    time.sleep(seconds)
    with Path(os.environ["FLYWHEEL_TEST_HOOK_LOG"]).open("a") as log:
        log.write(session.session_id + "\n")
    return 1.0
