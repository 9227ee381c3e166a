"""A scripted worker that holds chosen answers back, so that a client gives up on a call (an agent SDK's
timeout) while the worker still answers it: the proxy records the abandoned call, and the client's retry
is answered at once."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from aiohttp import web

from tests.support.proxy_harness import LoopThread
from tests.support.scripted_worker import ScriptedWorker


class DelayingWorker(ScriptedWorker):
    """`delay_next(seconds)`: the next /generate waits that long before it starts generating."""

    def __init__(self, **kwargs: Any) -> None:
        self._delays: deque[float] = deque()
        super().__init__(**kwargs)

    def delay_next(self, seconds: float) -> None:
        self._delays.append(seconds)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self._delays:
            await asyncio.sleep(self._delays.popleft())
        return await super()._generate(request)


def start_delaying_worker(servers: LoopThread) -> DelayingWorker:
    """A `DelayingWorker` serving on the servers' loop (stop it with `servers.call(worker.stop())`)."""

    async def start() -> DelayingWorker:
        worker = DelayingWorker()
        await worker.start()
        return worker

    return servers.call(start())
