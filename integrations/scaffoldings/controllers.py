"""Majority vote and best-of-N over Flywheel samples: subclasses of the Scaffolding controllers whose
`process` keeps to the call semantics every Scaffolding version shares (sample copies run through a
`ParallelProcess`, then the task takes the chosen sample's result), so they run the same on
TensorRT-LLM and on `compat`. Every sample is a session, and so a training sample of the group."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from integrations.scaffoldings.api import (
    BestOfNController,
    Controller,
    MajorityVoteController,
    ParallelProcess,
    Task,
)
from integrations.scaffoldings.compat.controller import adopt_result
from integrations.scaffoldings.compat.voting import best_index, majority_answer
from integrations.scaffoldings.sessions import CONTROLLER_NOTES, results_of

AnswerOf = Callable[[str], str | None]


def _samples(tasks: list[Task], count: int) -> list[list[Task]]:
    return [copy.deepcopy(tasks) for _ in range(count)]


def _run(
    controller: Controller, samples: list[list[Task]], kwargs: Mapping[str, Any] | None
) -> ParallelProcess:
    """Each sample through its own clone of `controller`."""
    clones = [controller.clone() for _ in samples]
    return ParallelProcess(clones, samples, [dict(kwargs or {}) for _ in samples])


class FlywheelMajorityVoteController(MajorityVoteController):
    """`sample_num` samples (at least `default_sample_num`), a vote on the answer `answer_of` extracts
    from each (ties: the answer given first); the task takes the first sample with the winning answer."""

    def __init__(self, generation_controller: Controller, default_sample_num: int = 1, *,
                 answer_of: AnswerOf) -> None:
        super().__init__(generation_controller, default_sample_num)
        self.answer_of = answer_of

    def clone(self) -> Controller:
        twin = copy.copy(self)
        twin.task_collections = copy.deepcopy(self.task_collections)
        twin.generation_controller = self.generation_controller.clone()
        return twin

    def process(  # type: ignore[override]
        self, tasks: list[Task], sample_num: int = 1, generation_kwargs: Mapping[str, Any] | None = None,
        majority_vote_kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        samples = _samples(tasks, max(sample_num, self.default_sample_num))
        yield _run(self.generation_controller, samples, generation_kwargs)
        index, answer = self.majority_vote(samples, **(majority_vote_kwargs or {}))
        adopt_result(tasks[0], samples[index][0])
        answers = [self._answer(s[0]) for s in samples]
        results_of(tasks[0])[CONTROLLER_NOTES] = {"vote": answer, "answers": answers, "index": index}

    def majority_vote(self, candidates_tasks: list[list[Task]], **kwargs: Any) -> tuple[int, str | None]:
        return majority_answer([self._answer(tasks[0]) for tasks in candidates_tasks])

    def _answer(self, task: Task) -> str | None:
        text = getattr(task, "output_str", None)
        return None if text is None else self.answer_of(text)


class FlywheelBestOfNController(BestOfNController):
    """`sample_num` samples (at least `default_sample_num`) scored by the reward controller (its
    `scores`; a FlywheelRewardController rewards every sample on the way); the task takes the best."""

    def clone(self) -> Controller:
        twin = copy.copy(self)
        twin.task_collections = copy.deepcopy(self.task_collections)
        twin.generation_controller = self.generation_controller.clone()
        twin.reward_controller = self.reward_controller.clone()
        return twin

    def process(  # type: ignore[override]
        self, tasks: list[Task], sample_num: int = 1, generation_kwargs: Mapping[str, Any] | None = None,
        reward_kwargs: Mapping[str, Any] | None = None, select_best_kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if len(tasks) != 1:
            raise ValueError(f"{type(self).__name__} takes one task, got {len(tasks)}")
        samples = _samples(tasks, max(sample_num, self.default_sample_num))
        yield _run(self.generation_controller, samples, generation_kwargs)
        flat = [s[0] for s in samples]
        yield from self.reward_controller.process(flat, **(reward_kwargs or {}))
        scores = list(getattr(self.reward_controller, "scores", None) or [])
        if len(scores) != len(flat):
            raise ValueError(f"the reward controller gave {len(scores)} scores for {len(flat)} samples")
        best, index = self.select_best(flat, scores, **(select_best_kwargs or {}))
        adopt_result(tasks[0], best)
        results_of(tasks[0])[CONTROLLER_NOTES] = {"scores": [_finite(s) for s in scores], "index": index}

    def select_best(self, tasks: list[Task], reward_values: Any, **kwargs: Any) -> tuple[Task, int]:
        index = best_index(list(reward_values))
        return tasks[index], index


def _finite(score: float) -> float | None:
    return score if score not in (float("inf"), float("-inf")) else None
