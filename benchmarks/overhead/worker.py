"""The benchmark's zero-latency upstream: the scripted SGLang worker of the tests (`POST /generate`,
stream and not, cumulative chunks; docs/architecture.md, "Wire protocols") that also answers
`POST /v1/chat/completions` (stream and not), so a peer proxy such as LiteLLM can sit in front of the
same process.

    python -m benchmarks.overhead.worker --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tests.support.scripted_worker import JSON_BODY, ScriptedWorker, default_token_fn, token_text

DEFAULT_MAX_TOKENS = 16


class BenchWorker(ScriptedWorker):
    """ScriptedWorker (no request log) plus an OpenAI chat route with the same canned tokens."""

    def __init__(self) -> None:
        super().__init__(record=False)

    def _build_app(self) -> web.Application:
        app = super()._build_app()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.served_model_name, "object": "model", "created": 0, "owned_by": "bench"}
        return _json({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = request[JSON_BODY] or {}
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        prompt = [len(str(message.get("content", ""))) for message in body.get("messages", ())]
        tokens = [token_text(default_token_fn(prompt, i, 0, 0)) for i in range(int(limit))]
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": body.get("model", self.served_model_name),
        }
        usage = {
            "prompt_tokens": sum(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": sum(prompt) + len(tokens),
        }
        if not body.get("stream"):
            message = {"role": "assistant", "content": "".join(tokens)}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
            return _json({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for i, text in enumerate(tokens):
            delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
            await _event(
                response, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            )
        last: dict[str, Any] = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            last["usage"] = usage
        await _event(response, last)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")


def _json(payload: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), content_type="application/json")


async def _serve(host: str, port: int) -> None:
    worker = BenchWorker()
    await worker.start(host, port)
    try:
        await asyncio.Event().wait()
    finally:
        await worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(_serve(args.host, args.port))


if __name__ == "__main__":
    main()
