"""`ScaffoldingLlm`: drives one clone of a prototype controller per prompt on an event loop of its own (a
daemon thread), sending each task the controller yields to the worker of its `worker_tag`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator, Mapping
from typing import Any, overload

from integrations.scaffoldings.compat.controller import Controller, ParallelProcess
from integrations.scaffoldings.compat.result import ScaffoldingResult
from integrations.scaffoldings.compat.task import Task
from integrations.scaffoldings.compat.worker import Worker


class ScaffoldingLlm:
    """`ScaffoldingLlm(controller, {worker_tag: worker})`: `generate(prompts)` blocks for the results,
    `generate_async(prompt)` returns one at once (await it, or call `.result()`). At most
    `max_parallel_requests` prompts run at a time. Call `shutdown()` when done."""

    def __init__(
        self, prototype_controller: Controller, workers: Mapping[Any, Worker], max_parallel_requests: int = 64
    ) -> None:
        if max_parallel_requests < 1:
            raise ValueError(f"max_parallel_requests must be >= 1, got {max_parallel_requests}")
        self.prototype_controller = prototype_controller
        self.workers = dict(workers)
        self.max_parallel_requests = max_parallel_requests
        self.loop = asyncio.new_event_loop()
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Future[None]] = set()
        self._closed = False
        self._thread = threading.Thread(target=self.loop.run_forever, name="scaffolding-llm", daemon=True)
        self._thread.start()

    def __enter__(self) -> ScaffoldingLlm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate_async(self, prompt: str) -> ScaffoldingResult:
        if self._closed:
            raise RuntimeError("this ScaffoldingLlm was shut down")
        result = ScaffoldingResult()
        controller = self.prototype_controller.clone()
        asyncio.run_coroutine_threadsafe(self._serve(controller, prompt, result), self.loop)
        return result

    @overload
    def generate(self, prompts: str) -> ScaffoldingResult: ...
    @overload
    def generate(self, prompts: list[str]) -> list[ScaffoldingResult]: ...

    def generate(self, prompts: str | list[str]) -> ScaffoldingResult | list[ScaffoldingResult]:
        """The finished result of each prompt (of the one prompt, for a string); raises the first
        request's error."""
        results = [self.generate_async(p) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        for result in results:
            result.result()
        return results[0] if isinstance(prompts, str) else results

    def shutdown(self, shutdown_workers: bool = False) -> None:
        """Wait for running requests, let workers release their event-loop resources, stop the loop."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._close_workers(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        if shutdown_workers:
            for worker in self.workers.values():
                worker.shutdown()

    async def _close_workers(self) -> None:
        if self._running:
            await asyncio.wait(self._running)
        for worker in self.workers.values():
            await worker.async_shutdown()

    async def _serve(self, controller: Controller, prompt: str, result: ScaffoldingResult) -> None:
        current = asyncio.current_task()
        assert current is not None
        self._running.add(current)
        if self._slots is None:  # sized on first use: callers may set max_parallel_requests after init
            self._slots = asyncio.Semaphore(self.max_parallel_requests)
        try:
            async with self._slots:
                output = await self._drive(controller.generate(prompt))
        except Exception as error:  # a request's failure belongs to its result, not to the loop
            result.set_exception(_first_leaf(error))
        else:
            result.set_output(output)
        finally:
            self._running.discard(current)

    async def _drive(self, process: Generator[Any, None, Any]) -> Any:
        """Run a controller's generator to its end; returns what it returns."""
        while True:
            try:
                yielded = next(process)
            except StopIteration as stop:
                return stop.value
            await self._dispatch(yielded)

    async def _dispatch(self, yielded: Any) -> None:
        async with asyncio.TaskGroup() as group:
            if isinstance(yielded, ParallelProcess):
                for sub in yielded.sub_gens:
                    group.create_task(self._drive(sub))
            elif isinstance(yielded, list) and all(isinstance(t, Task) for t in yielded):
                for task in yielded:
                    group.create_task(self._worker_for(task).run_task(task))
            else:
                raise TypeError(f"a controller yielded {yielded!r}; expected a list of tasks or a "
                                "ParallelProcess")

    def _worker_for(self, task: Task) -> Worker:
        worker = self.workers.get(task.worker_tag)
        if worker is None:
            known = ", ".join(map(str, self.workers)) or "none"
            raise LookupError(f"no worker for tag {task.worker_tag!r} of {type(task).__name__} "
                              f"(workers: {known})")
        return worker


def _first_leaf(error: BaseException) -> BaseException:
    """The first error inside (nested) exception groups: what failed, rather than the group around it."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error
