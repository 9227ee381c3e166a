"""Server-sent events: the framing of OpenAI's streams (`data: <json>`, named `event:`s, `data: [DONE]`)
and the response that sends them, noticing a client leaving without a task group per response.

Starlette's StreamingResponse (under uvicorn's ASGI 2.3) runs the body and a disconnect listener in an
anyio task group: a cancel scope, a wrapper task and their bookkeeping on every streamed response, about
a tenth of a streamed request's CPU in profiles. Our bodies are fed by their own reader tasks, so on a
disconnect it is enough to tell them to stop (`on_disconnect`): the body then ends by itself, its
generation recorded as aborted; the listener is one plain task, cancelled when the body is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    """One unnamed event (chat and legacy completion chunks, errors)."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def named_sse(event_type: str, payload: dict[str, Any]) -> bytes:
    """One named event (the Responses API's)."""
    return b"event: " + event_type.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


def _raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """`headers` as Starlette encodes a response's."""
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


_MEDIA_TYPE: Final = "text/event-stream"
_SSE_RAW_HEADERS: Final = _raw_headers(SSE_HEADERS)
_CONTENT_TYPE: Final = (b"content-type", f"{_MEDIA_TYPE}; charset=utf-8".encode("latin-1"))


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` from `content`, with `SSE_HEADERS` and `headers`; `on_disconnect` is called
    once if the client leaves first. A piece of `content` ending with `last_event` (`data: [DONE]`) is
    sent as the end of the response, in the same write as the chunked encoding's terminator rather than
    one more write after it."""

    def __init__(
        self, content: AsyncIterator[bytes], on_disconnect: Callable[[], None],
        headers: Mapping[str, str] | None = None, last_event: bytes | None = None,
    ) -> None:
        # What StreamingResponse.__init__ sets, with the headers Starlette would build from SSE_HEADERS
        # and the media type built once: every streamed call paid for encoding them again.
        self.body_iterator = content
        self.status_code = 200
        self.media_type = _MEDIA_TYPE
        self.background = None
        self.raw_headers = [*_SSE_RAW_HEADERS, *(_raw_headers(headers) if headers else ()), _CONTENT_TYPE]
        self._on_disconnect = on_disconnect
        self._last_event = last_event
        self._pieces = content

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for piece in self._pieces:
            if ended:
                logger.warning("an event after the stream's last one was dropped: %r", piece[:80])
                continue
            ended = self._last_event is not None and piece.endswith(self._last_event)
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        listener = asyncio.create_task(self._listen(receive))
        try:
            await self.stream_response(send)
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._on_disconnect()
