"""Workers of the Scaffolding layer: a worker runs the tasks of one role, picking a handler by the task's
exact type (`task_handlers`), as `tensorrt_llm.scaffolding.Worker` does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from integrations.scaffoldings.compat.task import Task, TaskStatus

TaskHandler = Callable[[Any, Any], Awaitable[TaskStatus]]
"""An async handler, called as `handler(worker, task)`."""


class Worker:
    """Runs tasks by type. Subclasses declare `task_handlers = {TaskType: handler}`."""

    task_handlers: ClassVar[dict[type, TaskHandler]] = {}

    def register_task_handler(self, task_cls: type[Task], handler: TaskHandler) -> None:
        """Add or replace the handler of `task_cls` for this worker's class (and its subclasses that
        declare no table of their own); other worker classes keep theirs."""
        worker_cls = type(self)
        if "task_handlers" not in worker_cls.__dict__:
            worker_cls.task_handlers = dict(worker_cls.task_handlers)
        worker_cls.task_handlers[task_cls] = handler

    async def run_task(self, task: Task) -> TaskStatus:
        handler = type(self).task_handlers.get(type(task))
        if handler is None:
            return TaskStatus.WORKER_NOT_SUPPORTED
        return await handler(self, task)

    def shutdown(self) -> None:
        """Release what the worker holds outside an event loop."""

    async def async_shutdown(self) -> None:
        """Release what the worker holds on the event loop it ran on."""

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
