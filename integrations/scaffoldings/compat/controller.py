"""Controllers of the Scaffolding layer: a controller's `process(tasks)` is a generator that yields lists
of tasks (run by workers before it resumes) or a `ParallelProcess` of sub-controllers; `generate(prompt)`
wraps a prompt in a task, runs `process` and returns the task's output. Names and call semantics follow
`tensorrt_llm.scaffolding.controller`."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Generator, Mapping, Sequence
from enum import Enum
from typing import Any

from integrations.scaffoldings.compat.result import ScaffoldingOutput
from integrations.scaffoldings.compat.task import GenerationTask, Task
from integrations.scaffoldings.compat.voting import best_index, digit_majority

logger = logging.getLogger(__name__)

Yielded = Any
"""What `process` yields: a list of tasks, or a `ParallelProcess`."""
Process = Generator[Yielded, None, Any]
RESULT_FIELDS = ("output_str", "output_tokens", "finish_reason", "logprobs", "context_logits")


class Controller:
    """Base controller; subclasses implement `process`."""

    def __init__(self) -> None:
        self.task_collections: dict[str, Any] = {}

    def clone(self) -> Controller:
        return copy.deepcopy(self)

    def generate(self, prompt: str, **kwargs: Any) -> Generator[Yielded, None, ScaffoldingOutput]:
        task = GenerationTask.create_from_prompt(prompt)
        yield from self.process([task], **kwargs)
        return task.create_scaffolding_output()

    def process(self, tasks: list[Task], **kwargs: Any) -> Process:
        raise NotImplementedError(f"{type(self).__name__} does not implement process()")


class ParallelProcess:
    """Sub-controllers run concurrently, each on its own task list; yielded by a parent's `process`."""

    def __init__(
        self, controllers: Sequence[Controller], tasks_list: Sequence[list[Task]],
        kwargs_list: Sequence[Mapping[str, Any]],
    ) -> None:
        if not len(controllers) == len(tasks_list) == len(kwargs_list):
            raise ValueError("ParallelProcess needs as many task lists and kwargs as controllers")
        triples = zip(controllers, tasks_list, kwargs_list, strict=True)
        self.sub_gens = [controller.process(tasks, **kwargs) for controller, tasks, kwargs in triples]


def adopt_result(target: Task, source: Task) -> None:
    """Give `target` the result fields (and, for chats, the messages) of `source`."""
    for name in RESULT_FIELDS:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))
    if hasattr(source, "customized_result_fields"):
        target.customized_result_fields = dict(source.customized_result_fields)  # type: ignore[attr-defined]
    if hasattr(source, "messages") and hasattr(target, "messages"):
        target.messages = list(source.messages)


class NativeGenerationController(Controller):
    """Tags tasks for the generation worker and fills the sampling fields a task leaves None."""

    class WorkerTag(Enum):
        GENERATION = "generation"

    def __init__(self, sampling_params: Mapping[str, Any] | None = None, streaming: bool = False) -> None:
        super().__init__()
        known = {f.name for f in dataclasses.fields(GenerationTask)}
        self.sampling_params: dict[str, Any] = {}
        for key, value in (sampling_params or {}).items():
            if key in known:
                self.sampling_params[key] = value
            else:
                logger.warning("%s is not a field of GenerationTask; ignored", key)
        self.streaming = streaming

    def process(self, tasks: list[Task], **kwargs: Any) -> Process:
        for task in tasks:
            task.worker_tag = self.WorkerTag.GENERATION
            for key, value in self.sampling_params.items():
                if getattr(task, key, None) is None:
                    setattr(task, key, value)
            task.streaming_output_flag = self.streaming
        yield tasks


class NativeRewardController(Controller):
    """Tags tasks for the reward worker, which scores them; subclasses leave the scores in `scores`."""

    class WorkerTag(Enum):
        REWARD = "reward"

    def __init__(self) -> None:
        super().__init__()
        self.scores: list[float] | None = None

    def process(self, tasks: list[Task], **kwargs: Any) -> Process:
        for task in tasks:
            task.worker_tag = self.WorkerTag.REWARD
        yield tasks


class MajorityVoteController(Controller):
    """Runs `sample_num` copies of the task through clones of the generation controller at once, votes
    (`majority_vote`) and gives the task the result of the first sample with the winning answer."""

    def __init__(self, generation_controller: Controller, default_sample_num: int = 1) -> None:
        super().__init__()
        self.generation_controller = generation_controller
        self.default_sample_num = default_sample_num

    def clone(self) -> Controller:
        twin = copy.copy(self)
        twin.task_collections = copy.deepcopy(self.task_collections)
        twin.generation_controller = self.generation_controller.clone()
        return twin

    def process(  # type: ignore[override]
        self, tasks: list[Task], sample_num: int = 1, generation_kwargs: Mapping[str, Any] | None = None,
        majority_vote_kwargs: Mapping[str, Any] | None = None,
    ) -> Process:
        count = max(sample_num, self.default_sample_num)
        samples = [copy.deepcopy(tasks) for _ in range(count)]
        yield ParallelProcess(
            [self.generation_controller.clone() for _ in range(count)], samples,
            [dict(generation_kwargs or {}) for _ in range(count)],
        )
        index, answer = self.majority_vote(samples, **(majority_vote_kwargs or {}))
        if answer is None:
            logger.warning("no sample gave an answer to vote on; keeping sample 0")
        adopt_result(tasks[0], samples[index][0])

    def majority_vote(self, candidates_tasks: list[list[Task]], **kwargs: Any) -> tuple[int, str | None]:
        """(index of the winning sample, its answer): the upstream default votes on `\\boxed{}` digits."""
        return digit_majority([getattr(tasks[0], "output_str", None) for tasks in candidates_tasks])


class BestOfNController(Controller):
    """Runs `sample_num` copies of one task, scores them with the reward controller (its `scores`) and
    gives the task the result of the best (`select_best`)."""

    def __init__(
        self, generation_controller: Controller, reward_controller: Controller, default_sample_num: int = 4
    ) -> None:
        super().__init__()
        self.generation_controller = generation_controller
        self.reward_controller = reward_controller
        self.default_sample_num = default_sample_num

    def clone(self) -> Controller:
        twin = copy.copy(self)
        twin.task_collections = copy.deepcopy(self.task_collections)
        twin.generation_controller = self.generation_controller.clone()
        twin.reward_controller = self.reward_controller.clone()
        return twin

    def process(  # type: ignore[override]
        self, tasks: list[Task], sample_num: int = 4, generation_kwargs: Mapping[str, Any] | None = None,
        reward_kwargs: Mapping[str, Any] | None = None, select_best_kwargs: Mapping[str, Any] | None = None,
    ) -> Process:
        if len(tasks) != 1:
            raise ValueError(f"BestOfNController takes one task, got {len(tasks)}")
        count = max(sample_num, self.default_sample_num)
        samples = [copy.deepcopy(tasks[0]) for _ in range(count)]
        yield ParallelProcess([self.generation_controller] * count, [[s] for s in samples],
                              [dict(generation_kwargs or {}) for _ in range(count)])
        yield from self.reward_controller.process(samples, **(reward_kwargs or {}))
        scores = getattr(self.reward_controller, "scores", None)
        if scores is None or len(scores) != count:
            raise ValueError(f"the reward controller left {scores!r} as scores; expected {count} numbers")
        best, _ = self.select_best(samples, scores, **(select_best_kwargs or {}))
        adopt_result(tasks[0], best)

    def select_best(self, tasks: list[Task], reward_values: Sequence[float | None],
                    **kwargs: Any) -> tuple[Task, int]:
        """The highest-scored sample and its index; the first one on a tie."""
        index = best_index(reward_values)
        return tasks[index], index
