"""A scripted OpenAI-compatible judge for tests: an aiohttp.web app on 127.0.0.1 serving
POST /v1/chat/completions with a well-formed `chat.completion` whose content a function of the request
chooses (the test passes it in).

It records every request and counts the requests in flight (`max_in_flight`). With `hold_until` set, each
request waits (up to `hold_timeout_s`) until that many are in flight at once before it is answered, so a
test can tell calls that overlap from calls that queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class JudgeCall:
    """One request the judge received, in arrival order (`index` from 0)."""

    index: int
    body: dict[str, Any]
    headers: dict[str, str]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def prompt(self) -> str:
        """Every message's content, joined: what the judge was shown."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


@dataclass(frozen=True)
class Failure:
    """Answer a request with this HTTP status (an OpenAI-style error body) instead of a completion."""

    status: int
    message: str = "scripted failure"


Reply = Callable[[JudgeCall], "str | Failure"]
"""Chooses the answer to a request: the assistant content, or a Failure."""


def in_order(answers: Sequence[str | Failure]) -> Reply:
    """Answers in arrival order (the last one repeated past the end)."""
    return lambda call: answers[min(call.index, len(answers) - 1)]


class ScriptedJudge:
    """The scripted judge server. Use `async with ScriptedJudge(reply) as judge:`; `judge.base_url` is the
    `…/v1` base URL for the OpenAI client."""

    def __init__(self, reply: Reply, *, hold_until: int = 0, hold_timeout_s: float = 0.5) -> None:
        self.reply = reply
        self.hold_until = hold_until
        self.hold_timeout_s = hold_timeout_s
        self.calls: list[JudgeCall] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.base_url = ""
        self._released = asyncio.Event()
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Serve on a free port of 127.0.0.1; returns the base URL."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedJudge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _chat(self, request: web.Request) -> web.Response:
        call = JudgeCall(index=len(self.calls), body=await request.json(), headers=dict(request.headers))
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._hold()
            answer = self.reply(call)
            if isinstance(answer, Failure):
                error = {"message": answer.message, "type": "server_error", "param": None, "code": None}
                return web.json_response({"error": error}, status=answer.status)
            return web.json_response(completion(call.body, answer, next(self._ids)))
        finally:
            self.in_flight -= 1

    async def _hold(self) -> None:
        if self.hold_until <= 0:
            return
        if self.in_flight >= self.hold_until:
            self._released.set()
        try:
            await asyncio.wait_for(self._released.wait(), self.hold_timeout_s)
        except TimeoutError:
            pass


def completion(body: dict[str, Any], content: str, number: int) -> dict[str, Any]:
    """A well-formed `chat.completion` object answering `body` with `content`."""
    prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [])
    completion_tokens = len(content.split())
    return {
        "id": f"chatcmpl-judge-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "judge"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
