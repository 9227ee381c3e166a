"""The OpenAI-compatible routes: chat, legacy text completions and the Responses API (under /v1 and, as
AReaL offers, at the root) and the model list. Every route needs a key (`require_principal`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.routing import Route, request_response
from starlette.types import Receive, Scope, Send

from proxy.auth import Principal, require_principal
from proxy.chat import create_chat_completion
from proxy.completions import create_completion
from proxy.errors import OpenAIError
from proxy.responses_api import create_response, retrieve_response
from proxy.services import ProxyServices, get_services

OWNER = "flywheel"


class RawRoute:
    """The ASGI app of a plain route to `endpoint(request) -> Response`, with Starlette's exception
    handling (so OpenAIError answers as on any route). It names itself as the scope's route, which
    FastAPI's router sets only for its own routes: the request metrics are labelled by its path."""

    def __init__(self, path: str, endpoint: Callable[[Request], Awaitable[Response]]) -> None:
        self.path = path
        self._app = request_response(endpoint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self
        await self._app(scope, receive, send)


def build_openai_router() -> APIRouter:
    router = APIRouter()
    for path in ("/v1/chat/completions", "/chat/completions"):
        # A plain Starlette route: the handler takes the raw request (proxy/request_body.py), so FastAPI's
        # per-request dependency solving and sub-response (~5% of a request's CPU) buy nothing here.
        endpoint = RawRoute(path, create_chat_completion)
        router.routes.append(Route(path, endpoint, methods=["POST"], include_in_schema=False))
    # Never matched (the route above answers first): keeps the path in the OpenAPI schema.
    router.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    for path in ("/v1/completions", "/completions"):
        router.add_api_route(
            path, create_completion, methods=["POST"], include_in_schema=path.startswith("/v1")
        )
    for path in ("/v1/responses", "/responses"):
        documented = path.startswith("/v1")
        router.add_api_route(path, create_response, methods=["POST"], include_in_schema=documented)
        router.add_api_route(
            f"{path}/{{response_id}}", retrieve_response, methods=["GET"], include_in_schema=documented
        )
    router.add_api_route("/v1/models", list_models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    return router


def _model_object(services: ProxyServices) -> dict[str, Any]:
    return {
        "id": services.served_model_name,
        "object": "model",
        "created": services.started_at,
        "owned_by": OWNER,
        "max_model_len": services.tokenizer.context_length,
    }


async def list_models(
    _principal: Annotated[Principal, Depends(require_principal)],
    services: Annotated[ProxyServices, Depends(get_services)],
) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(services)]}


async def retrieve_model(
    model_id: str,
    _principal: Annotated[Principal, Depends(require_principal)],
    services: Annotated[ProxyServices, Depends(get_services)],
) -> dict[str, Any]:
    if model_id != services.served_model_name:
        raise OpenAIError(
            404, f"The model '{model_id}' does not exist or you do not have access to it.",
            "invalid_request_error", param="model", code="model_not_found",
        )
    return _model_object(services)
