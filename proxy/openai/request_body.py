"""A JSON request body decoded once and validated, with the errors FastAPI's body parameters give (so
the OpenAI-shaped 400s of proxy/errors.py are unchanged): hot routes take the raw `Request` instead of
a body parameter, which spares FastAPI's dependency solving and a second JSON decode of the body.
FastAPI's order is kept: a body that is not JSON is refused first, then the key is checked
(the route's dependency), then the body is validated."""

from __future__ import annotations

import email.message
from typing import Any, Final, TypeVar

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)
NO_BODY: Final = object()
"""`decoded_body` of an empty body (JSON `null` is None)."""


async def decoded_body(request: Request) -> Any:
    """The body decoded as FastAPI reads it for a body parameter (before the route's dependencies run):
    JSON for application/json or +json, else the raw bytes (which then fail validation); NO_BODY if empty.
    RequestValidationError (json_invalid) for JSON that does not parse."""
    raw = await request.body()
    if not raw:
        return NO_BODY
    if not _is_json(request.headers.get("content-type")):
        return raw
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {},
              "ctx": {"error": str(exc)}}],
            body=raw,
        ) from exc


def validated_body(payload: Any, model: type[Model]) -> Model:
    """`decoded_body`'s payload as `model`; RequestValidationError with FastAPI's body locations."""
    if payload is NO_BODY:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        return model.model_validate(payload, from_attributes=True)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=payload) from exc


def _is_json(content_type: str | None) -> bool:
    if content_type == "application/json":
        return True
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")
