"""The request context of every proxy request (a pure ASGI middleware, no task per request): its id, its
count and latency per route and status, the requests in flight, an optional log line, and the key cache
cleared after an RL call that changed keys or sessions."""

from __future__ import annotations

import logging
import random
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import REQUEST_ID_HEADER
from proxy.metrics import route_label

logger = logging.getLogger(__name__)

_MAX_CLIENT_REQUEST_ID = 128
_REQUEST_ID = REQUEST_ID_HEADER.encode()
_RL_PREFIX = "/rl/"


class RequestContextMiddleware:
    """Pure ASGI (no per-request task): gives each request an id (the client's `x-request-id` if it
    sent a sane one), returns it as `x-request-id`, counts and times the request per route, and logs
    it when asked."""

    def __init__(self, app: ASGIApp, log_requests: bool = False) -> None:
        self.app = app
        self.log_requests = log_requests
        # Request ids need to be unique, not unguessable: a seeded PRNG instead of an os.urandom
        # syscall per request, which showed in profiles under load.
        self._ids = random.Random(secrets.randbits(128))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope) or f"req_{self._ids.getrandbits(96):024x}"
        scope.setdefault("state", {})["request_id"] = request_id
        header = (_REQUEST_ID, request_id.encode())
        started = time.perf_counter()
        status = 500
        services: Any = getattr(scope["app"].state, "services", None)
        if services is not None:
            services.metrics.in_flight.enter(scope)

        changes_keys = scope["method"] == "POST" and scope["path"].startswith(_RL_PREFIX)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
                if changes_keys and status < 400:
                    # The call has committed (a session ended, a key rebound); before its caller can
                    # act on the answer, no cached key may outlive what it changed.
                    _clear_key_cache(scope)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._observe(scope, status, time.perf_counter() - started, request_id, services)

    def _observe(self, scope: Scope, status: int, elapsed: float, request_id: str, services: Any) -> None:
        if services is not None:
            services.metrics.in_flight.leave(scope)
            services.metrics.observe_request(route_label(scope), status, elapsed)
        if self.log_requests:
            logger.info("%s %s -> %d in %.1f ms (request %s)", scope["method"], scope["path"], status,
                        elapsed * 1000, request_id)


def _clear_key_cache(scope: Scope) -> None:
    services: Any = getattr(scope["app"].state, "services", None)
    if services is not None:
        services.key_cache.clear()


def _request_id(scope: Scope) -> str | None:
    """The client's own x-request-id, if it sent a sane one."""
    headers = scope.get("headers", ())
    if _REQUEST_ID not in dict(headers):  # most clients send none: looked for at C speed
        return None
    for name, value in headers:
        if name == _REQUEST_ID and 0 < len(value) <= _MAX_CLIENT_REQUEST_ID:
            return value.decode("latin-1")
    return None
