"""JSON replies in the shapes SGLang 0.5.23's HTTP server answers with, errors included."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response

from serving.engine.protocol import BadRequest, ContractError, MalformedRequest


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(content), status_code=status_code, media_type="application/json")


def error_response(exc: MalformedRequest | ContractError | BadRequest) -> Response:
    """400 in the shape SGLang uses for this kind of refusal."""
    message = str(exc)
    if isinstance(exc, ContractError):  # the schema gate: {"error": "<serde text>"}
        return json_response({"error": message}, 400)
    if isinstance(exc, BadRequest):  # a ValueError in the tokenizer manager
        return json_response({"error": {"message": message}}, 400)
    # FastAPI's RequestValidationError, as SGLang reshapes it (ErrorResponse)
    return json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                          "code": 400}, 400)


async def json_object(request: Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object, or MalformedRequest (an empty body is `{}` when `empty_ok`)."""
    body = await request.body()
    if not body.strip() and empty_ok:
        return {}
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"JSON decode error: {exc}") from exc
    if not isinstance(value, dict):
        raise MalformedRequest("The request body must be a JSON object.")
    return value


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
          required: bool = False) -> Any:
    """One typed field of a control request body (MalformedRequest when absent or mistyped)."""
    if name not in body or body[name] is None:
        if required:
            raise MalformedRequest(f"Field required: {name}")
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        raise MalformedRequest(f"{name}: wrong type {type(value).__name__}")
    return value
