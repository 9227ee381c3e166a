"""The model probes agents send before chatting, answered with the served model's true name and context
length (the one the proxy enforces), so an agent sizes its conversations to what the proxy accepts.

hermes-agent (agent/model_metadata.py) asks a local endpoint `GET /api/v1/models` (LM Studio's native
list: a 200 makes it treat the server as LM Studio and read `models[].key` and
`models[].loaded_instances[].config.context_length`), then `POST /api/show` (Ollama's: it reads
`model_info["<arch>.context_length"]`, `parameters` ("num_ctx N") and `capabilities`), then the OpenAI
`GET /v1/models/{id}` and `GET /v1/models` (proxy/openai/routes.py; `max_model_len`). A non-200 from
any of them only makes it try the next, so unknown model names get each API's own 404.

Same keys as the OpenAI routes (`require_principal`): agents send their key with every probe."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from proxy.auth import Principal, require_principal
from proxy.bodies import decoded_json, read_body
from proxy.errors import OpenAIError
from proxy.openai.routes import OWNER
from proxy.services import ProxyServices, get_services

_MODIFIED_AT = "1970-01-01T00:00:00Z"


def build_probe_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/api/v1/models", lmstudio_models, methods=["GET"], include_in_schema=False)
    router.add_api_route("/api/show", ollama_show, methods=["POST"], include_in_schema=False)
    return router


async def lmstudio_models(
    _principal: Annotated[Principal, Depends(require_principal)],
    services: Annotated[ProxyServices, Depends(get_services)],
) -> dict[str, Any]:
    """LM Studio's `GET /api/v1/models`: the served model, loaded, with the context it accepts."""
    name, context = services.model_name, services.tokenizer.context_length
    model = {
        "type": "llm",
        "publisher": OWNER,
        "key": name,
        "display_name": name,
        "architecture": _architecture(services),
        "quantization": None,
        "size_bytes": None,
        "params_string": None,
        "loaded_instances": [{"id": name, "config": {"context_length": context}}],
        "max_context_length": context,
        "format": None,
        "capabilities": {"vision": False, "trained_for_tool_use": _tools(services)},
        "description": None,
    }
    return {"models": [model]}


async def ollama_show(
    request: Request,
    _principal: Annotated[Principal, Depends(require_principal)],
    services: Annotated[ProxyServices, Depends(get_services)],
) -> JSONResponse:
    """Ollama's `POST /api/show` `{"model"|"name": ...}`; errors as Ollama words them (`{"error"}`)."""
    limits = services.config.limits
    try:
        raw = await read_body(request, limits.max_body_bytes)
        body = decoded_json(raw, limits.max_json_depth) if raw.strip() else {}
    except OpenAIError as exc:  # too large, not JSON: the same refusal, in Ollama's words
        return JSONResponse({"error": exc.message}, status_code=exc.status)
    name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        return JSONResponse({"error": "model is required"}, status_code=400)
    if name != services.model_name:
        return JSONResponse({"error": f"model '{name}' not found"}, status_code=404)
    arch, context = _architecture(services) or "unknown", services.tokenizer.context_length
    capabilities = ["completion"]
    if _tools(services):
        capabilities.append("tools")
    if services.config.reasoning_parser:
        capabilities.append("thinking")
    return JSONResponse({
        "modelfile": "",
        "parameters": f"num_ctx {context}",
        "template": str(services.tokenizer.tokenizer.chat_template),
        "details": {
            "parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
            "parameter_size": "", "quantization_level": "",
        },
        "model_info": {"general.architecture": arch, f"{arch}.context_length": context},
        "capabilities": capabilities,
        "modified_at": _MODIFIED_AT,
    })


def _tools(services: ProxyServices) -> bool:
    return services.config.tool_call_parser != "none"


def _architecture(services: ProxyServices) -> str | None:
    """The served model's `model_type` from its config.json, if the tokenizer's folder has one."""
    return _model_type(str(getattr(services.tokenizer.tokenizer, "name_or_path", "") or ""))


@lru_cache(maxsize=8)
def _model_type(model_dir: str) -> str | None:
    config_file = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_file.read_text()) if model_dir and config_file.is_file() else {}
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) and value else None
