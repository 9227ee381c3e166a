"""The OpenAI-compatible routes: chat, legacy text completions and the Responses API (under /v1 and, as
AReaL offers, at the root) and the model list. Every route needs a key (`require_principal`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from proxy.auth import Principal, require_principal
from proxy.bodies import openapi_body
from proxy.errors import OpenAIError
from proxy.hot_routes import Endpoint
from proxy.openai.chat import ChatApi
from proxy.openai.completions import CompletionsApi
from proxy.openai.pipeline import Api, endpoint, serve_call
from proxy.openai.responses.api import ResponsesApi, retrieve_response
from proxy.services import ProxyServices, get_services

OWNER = "flywheel"


def hot_routes() -> dict[str, Endpoint]:
    """The routes `ProxyApp` serves ahead of FastAPI (proxy/hot_routes.py): the inference POSTs, under
    /v1 and at the root, each an API on the one call pipeline (proxy/openai/pipeline.py), which takes the
    raw request (proxy/openai/request_body.py)."""
    # Straight to the pipeline (a partial, not `endpoint`'s wrapper): one coroutine frame less per call.
    return {path: functools.partial(serve_call, api=api) for path, api in _hot_apis().items()}


def _hot_apis() -> dict[str, Api[Any]]:
    apis: dict[str, Api[Any]] = {
        "chat/completions": ChatApi(), "completions": CompletionsApi(), "responses": ResponsesApi(),
    }
    return {f"{prefix}/{name}": api for name, api in apis.items() for prefix in ("/v1", "")}


def build_openai_router() -> APIRouter:
    router = APIRouter()
    for path, api in _hot_apis().items():
        # POSTs never reach these (ProxyApp answers them first); they keep the path, and its body's
        # schema, in the OpenAPI document and answer other methods 405, as any route does.
        router.add_api_route(path, endpoint(api), methods=["POST"], include_in_schema=path.startswith("/v1"),
                             openapi_extra=openapi_body(api.body_model))
    for path in ("/v1/responses", "/responses"):
        documented = path.startswith("/v1")
        router.add_api_route(
            f"{path}/{{response_id}}", retrieve_response, methods=["GET"], include_in_schema=documented
        )
    router.add_api_route("/v1/models", list_models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"])
    return router


def _model_object(services: ProxyServices) -> dict[str, Any]:
    return {
        "id": services.model_name,
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
    if model_id != services.model_name:
        raise OpenAIError(
            404, f"The model '{model_id}' does not exist or you do not have access to it.",
            "invalid_request_error", param="model", code="model_not_found",
        )
    return _model_object(services)
