"""`FlywheelTrajectoryMaker`: the controller that turns a Scaffolding controller's samples into Flywheel
training data. Per prompt it opens a group (`POST /rl/v1/groups`, the task from `task_for(prompt)`),
binds the prompt's task to the group's sessions, runs the controller (`rollouts` copies of it, each
making `samples_per_rollout` generation tasks: one session each), has the reward controller reward and
end every sample's session, and ends sessions no sample used. Its output carries the `Rollout`."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from integrations.scaffoldings.api import Controller, GenerationTask, ParallelProcess, ScaffoldingOutput, Task
from integrations.scaffoldings.compat.controller import adopt_result
from integrations.scaffoldings.reward_controller import FlywheelRewardController
from integrations.scaffoldings.rl_tasks import EndSessionTask, OpenGroupTask
from integrations.scaffoldings.sessions import (
    COMPLETION_ID,
    CONTROLLER_NOTES,
    ERROR,
    REWARD,
    REWARD_DETAILS,
    ROLLOUT,
    SessionPool,
    bind,
    results_of,
    session_id_of,
)

TaskFor = Callable[[str], Mapping[str, Any]]
"""The RL task of a prompt (what the group stores and reward hooks and functions read, e.g. the gold
`answer`)."""


@dataclass(frozen=True)
class Sample:
    """One sample: its session, its completion, what it answered and its reward."""

    session_id: str | None
    completion_id: str | None
    text: str | None
    reward: float | None
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    """A prompt's group: its samples (sessions), and which one the controller chose as its answer."""

    group_id: str
    task: dict[str, Any]
    samples: list[Sample]
    chosen: int | None
    text: str | None
    controller: dict[str, Any] = field(default_factory=dict)
    """What the controller recorded on its answer (e.g. a vote's answers, best-of-N's scores)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FlywheelOutput(ScaffoldingOutput):
    """A ScaffoldingOutput that also carries the prompt's `Rollout`."""

    rollout: Rollout | None = None


class FlywheelTrajectoryMaker(Controller):
    """Wraps `controller` (any Scaffolding controller whose generation tasks run on a FlywheelWorker) and
    `reward_controller`. Each prompt's group has `rollouts × samples_per_rollout` sessions; for GRPO,
    a plain generation controller with `rollouts=G` gives G samples of one problem in one group."""

    def __init__(
        self, controller: Controller, reward_controller: FlywheelRewardController, *, task_for: TaskFor,
        rollouts: int = 1, samples_per_rollout: int = 1, controller_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if rollouts < 1 or samples_per_rollout < 1:
            raise ValueError("rollouts and samples_per_rollout must be >= 1")
        self.controller = controller
        self.reward_controller = reward_controller
        self.task_for = task_for
        self.rollouts = rollouts
        self.samples_per_rollout = samples_per_rollout
        self.controller_kwargs = dict(controller_kwargs or {})

    @property
    def group_size(self) -> int:
        return self.rollouts * self.samples_per_rollout

    def generate(self, prompt: str, **kwargs: Any) -> Any:
        task = GenerationTask.create_from_prompt(prompt)
        yield from self.process([task], **kwargs)
        rollout = results_of(task).get(ROLLOUT)
        return FlywheelOutput(task.output_str or "", list(task.output_tokens or []), rollout=rollout)

    def process(self, tasks: list[Task], **kwargs: Any) -> Any:
        groups = [OpenGroupTask(size=self.group_size, task=dict(self.task_for(_prompt(t))),
                                reward=self.reward_controller.session_hooks()) for t in tasks]
        yield groups
        pools = [SessionPool(g.group_id, g.sessions) for g in groups]
        for task, pool, group in zip(tasks, pools, groups, strict=True):
            bind(task, pool, group.task)
        yield from self._run_controller(tasks)
        samples = [sample for pool in pools for sample in pool.leased_tasks()]
        unrewarded = [s for s in samples if REWARD not in results_of(s)]
        if unrewarded:
            yield from self.reward_controller.process(unrewarded)
        idle = [EndSessionTask(session_id=str(s.session_id)) for pool in pools for s in pool.unleased()]
        if idle:
            yield idle
        for task, pool, group in zip(tasks, pools, groups, strict=True):
            results_of(task)[ROLLOUT] = _rollout(task, pool, group)

    def _run_controller(self, tasks: list[Task]) -> Any:
        """Each task through its own clones of the controller: itself for one rollout, else copies (all
        leasing from the task's pool), the task then taking the first copy's result."""
        units = {id(t): [t] if self.rollouts == 1 else [copy.deepcopy(t) for _ in range(self.rollouts)]
                 for t in tasks}
        runs = [unit for t in tasks for unit in units[id(t)]]
        yield ParallelProcess([self.controller.clone() for _ in runs], [[unit] for unit in runs],
                              [dict(self.controller_kwargs) for _ in runs])
        for task in tasks:
            if self.rollouts > 1:
                adopt_result(task, units[id(task)][0])


def _prompt(task: Any) -> str:
    return str(getattr(task, "input_str", "") or "")


def _sample(task: Any) -> Sample:
    fields = results_of(task)
    return Sample(session_id_of(task), fields.get(COMPLETION_ID), getattr(task, "output_str", None),
                  fields.get(REWARD), fields.get(ERROR), dict(fields.get(REWARD_DETAILS) or {}))


def _rollout(task: Any, pool: SessionPool, group: OpenGroupTask) -> Rollout:
    samples = [_sample(s) for s in pool.leased_tasks()]
    chosen_id = results_of(task).get(COMPLETION_ID)
    chosen = next((i for i, s in enumerate(samples) if chosen_id and s.completion_id == chosen_id), None)
    notes = dict(results_of(task).get(CONTROLLER_NOTES) or {})
    text = getattr(task, "output_str", None)
    return Rollout(str(group.group_id), dict(group.task or {}), samples, chosen, text, notes)
