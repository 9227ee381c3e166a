"""What `ScaffoldingLlm.generate_async` hands back: a `ScaffoldingResult` whose `outputs[0]` becomes the
request's `ScaffoldingOutput`, readable from any thread or event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class ScaffoldingOutput:
    text: str
    token_ids: list[int]
    data: Any = None


class ScaffoldingResult:
    """One request's outcome. `result()` blocks, `await result` waits; both raise the request's error."""

    def __init__(self) -> None:
        self.outputs: list[Any] = [ScaffoldingOutput("", [])]
        self.task_collections: Mapping[str, Any] | None = None
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

    @property
    def finished(self) -> bool:
        return self._future.done()

    def set_output(self, output: Any) -> None:
        if output is not None:
            self.outputs[0] = output
        self._future.set_result(None)

    def set_exception(self, error: BaseException) -> None:
        self._future.set_exception(error)

    def set_task_collections(self, task_collections: Mapping[str, Any]) -> None:
        self.task_collections = task_collections

    def result(self, timeout: float | None = None) -> ScaffoldingResult:
        """Wait for the request; TimeoutError after `timeout` seconds, else the request's own error."""
        self._future.result(timeout)
        return self

    async def aresult(self) -> ScaffoldingResult:
        await asyncio.wrap_future(self._future)
        return self

    def __await__(self) -> Generator[Any, None, ScaffoldingResult]:
        return self.aresult().__await__()
