"""The Messages API's routes, under /v1 and at the root like the OpenAI ones: served ahead of FastAPI
(proxy/hot_routes.py) and documented in the OpenAPI document, every failure answered in Anthropic's
error shape (proxy/errors.py `anthropic_error_answer`), which Anthropic's clients read."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy.anthropic.api import MessagesApi, count_tokens
from proxy.anthropic.schemas import CountTokensRequest, MessagesRequest
from proxy.bodies import openapi_body
from proxy.errors import anthropic_error_answer
from proxy.hot_routes import Endpoint
from proxy.openai.pipeline import serve_call

PREFIXES = ("/v1", "")


def hot_routes() -> dict[str, Endpoint]:
    """`POST /v1/messages` (the call pipeline) and `POST /v1/messages/count_tokens`, and the same at the
    root."""
    messages = anthropic_errors(functools.partial(serve_call, api=MessagesApi()))
    counting = anthropic_errors(count_tokens)
    routes: dict[str, Endpoint] = {}
    for prefix in PREFIXES:
        routes[f"{prefix}/messages"] = messages
        routes[f"{prefix}/messages/count_tokens"] = counting
    return routes


def anthropic_errors(endpoint: Endpoint) -> Endpoint:
    """`endpoint`, its failures answered in Anthropic's shape rather than by the hot route's OpenAI one."""

    async def serve(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:  # the route's error boundary: every failure is answered, as HotRoute does
            return await anthropic_error_answer(request, exc)

    return serve


def build_anthropic_router() -> APIRouter:
    """The routes' entries in the OpenAPI document (POSTs never reach them: `ProxyApp` answers first);
    other methods are answered 405, as on any route."""
    router = APIRouter()
    for path, endpoint in hot_routes().items():
        model = CountTokensRequest if path.endswith("count_tokens") else MessagesRequest
        router.add_api_route(path, endpoint, methods=["POST"], include_in_schema=path.startswith("/v1"),
                             openapi_extra=openapi_body(model))
    return router
