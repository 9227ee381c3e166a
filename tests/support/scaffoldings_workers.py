"""In-process Scaffolding workers and controllers for unit tests of the Scaffolding layer: a generation
worker that answers from a script (in call order, or by prompt), optionally taking each task's Flywheel
session the way `FlywheelWorker` does, and a reward controller with set scores."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from integrations.scaffoldings.compat import Controller, GenerationTask, Task, TaskStatus, Worker
from integrations.scaffoldings.sessions import COMPLETION_ID, SESSION_ID, lease_session, results_of


class ScriptedGenerationWorker(Worker):
    """Answers the i-th generation task it runs with `replies[i]` (or `reply(task)`), after `delay_s`;
    with `lease`, each task first takes its session and gets the ids a FlywheelWorker would fill."""

    def __init__(
        self, replies: Sequence[str] = (), *, reply: Callable[[Any], str] | None = None, delay_s: float = 0.0,
        lease: bool = False,
    ) -> None:
        self.replies = list(replies)
        self.reply = reply
        self.delay_s = delay_s
        self.lease = lease
        self.seen: list[Any] = []
        self.running = 0
        self.most_running = 0
        self.closed = False

    async def generate(self, task: GenerationTask) -> TaskStatus:
        index = len(self.seen)
        self.seen.append(task)
        if self.lease:
            session = lease_session(task)
            assert session is not None, "the task is bound to no session"
            results_of(task).update({SESSION_ID: session.session_id, COMPLETION_ID: f"cmpl-{index}"})
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        await asyncio.sleep(self.delay_s)
        self.running -= 1
        task.output_str = self.reply(task) if self.reply is not None else self.replies[index]
        task.output_tokens = [index]
        return TaskStatus.SUCCESS

    async def async_shutdown(self) -> None:
        self.closed = True

    task_handlers = {GenerationTask: generate}  # noqa: RUF012


class FixedScores(Controller):
    """A reward controller whose `scores` are set in advance; it runs no task."""

    def __init__(self, scores: Sequence[float]) -> None:
        super().__init__()
        self.fixed = list(scores)
        self.scores: list[float] | None = None
        self.scored: list[Task] = []

    def process(self, tasks: list[Task], **kwargs: Any) -> Any:
        self.scored = list(tasks)
        self.scores = self.fixed[: len(tasks)]
        yield from ()


class OnTask(Controller):
    """Runs `controller` on a task prepared (and bound to a session pool) beforehand, whatever the prompt,
    so tests can drive the Flywheel controllers through `ScaffoldingLlm` without the RL API."""

    def __init__(self, controller: Controller, task: Task) -> None:
        super().__init__()
        self.controller = controller
        self.task = task

    def clone(self) -> OnTask:
        return self  # the prepared task must stay the one the test inspects

    def generate(self, prompt: str, **kwargs: Any) -> Any:
        yield from self.controller.process([self.task])
        return self.task.create_scaffolding_output()
