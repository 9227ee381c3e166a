"""The inference routes served ahead of FastAPI's middleware stack.

Every request to a FastAPI app passes uvicorn's proxy-headers middleware, Starlette's server-error and
exception middleware, FastAPI's exit-stack middleware and the router's scan of every route, and each of
their send wrappers on the way out: a tenth of a chat completion's proxy CPU in profiles, for nothing
the inference handlers use (they take the raw request: proxy/openai/request_body.py).
`ProxyApp` answers POSTs to its hot paths directly, with what those layers did for them: the request
context (request id, metrics: proxy/request_context.py) and the same OpenAI-shaped
error answers (proxy/errors.py `error_answer`). Everything else goes through FastAPI as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import error_answer

Endpoint = Callable[[Request], Awaitable[Response]]


class IndexedHeaders(Headers):
    """A request's headers looked up through a dict built once, at C speed: Starlette's scan the raw list
    in Python on every lookup, and a call looks up several (its key, its body's length and type). The
    first of repeated headers wins, as in Starlette."""

    def __init__(self, scope: Scope) -> None:
        super().__init__(scope=scope)
        self._index = dict(reversed(self._list))

    def __getitem__(self, key: str) -> str:
        value = self._index.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def get(self, key: str, default: Any = None) -> Any:
        value = self._index.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1") in self._index


class HotRequest(Request):
    """The request of a hot route: its headers are `IndexedHeaders`."""

    _indexed: IndexedHeaders | None = None

    @property
    def headers(self) -> Headers:
        indexed = self._indexed
        if indexed is None:
            self._indexed = indexed = IndexedHeaders(self.scope)
        return indexed


class HotRoute:
    """The ASGI app of one hot path: `endpoint(request) -> Response`, its exceptions answered as the
    app's exception handlers answer them. It names itself as the scope's route (`path`), which the
    request metrics are labelled by."""

    def __init__(self, path: str, endpoint: Endpoint) -> None:
        self.path = path
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self
        request = HotRequest(scope, receive, send)
        try:
            response = await self.endpoint(request)
        except Exception as exc:
            response = await error_answer(request, exc)
        await response(scope, receive, send)


class ProxyApp(FastAPI):
    """FastAPI, with POSTs to the paths of `hot_routes` answered by their app (a `HotRoute` wrapped in
    the request-context middleware) before FastAPI's own stack."""

    hot_routes: dict[str, ASGIApp]

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.hot_routes = {}

    def add_hot_route(self, path: str, app: ASGIApp) -> None:
        self.hot_routes[path] = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "\x00" in scope["path"]:
            # A path holding a NUL (`%00`) names nothing here, and would reach the database in a path
            # parameter, which Postgres cannot even compare: an unknown URL, before any route runs.
            response = await error_answer(Request(scope, receive), StarletteHTTPException(404))
            await response(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            hot = self.hot_routes.get(scope["path"])
            if hot is not None:
                scope["app"] = self  # what Starlette sets: request.app, and so the app's state
                await hot(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
