"""A call's JSON request body, read, decoded once, validated and measured against the limits, with the
errors FastAPI's body parameters give (so the OpenAI-shaped 400s of proxy/errors.py are unchanged):
hot routes take the raw `Request` instead of a body parameter, which spares FastAPI's dependency solving
and a second JSON decode of the body.

Unlike FastAPI, which reads the body before the route's dependencies run, the pipeline checks the key
first, so a bad key is refused before a byte of the body is read (proxy/bodies.py reads it, under
`proxy.limits.max_body_bytes`). A large body is decoded, checked and validated in a worker thread."""

from __future__ import annotations

import asyncio
import email.message
from typing import Any, Final, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from proxy.bodies import decoded_json, read_body
from proxy.config import LimitsConfig
from proxy.errors import OpenAIError
from proxy.openai.schemas import CallBody, CallSize

Model = TypeVar("Model", bound=CallBody)
NO_BODY: Final = object()
"""`decoded_payload` of an empty body (JSON `null` is None)."""


async def parsed_body(
    request: Request, model: type[Model], limits: LimitsConfig, thread_above_bytes: int
) -> tuple[Any, Model, bool]:
    """(the decoded payload, the body as `model`, whether it is large), its call size within `limits`;
    read under the body limit and, when larger than `thread_above_bytes` (large), decoded and validated
    in a worker thread: thousands of messages take long enough to delay every other request on the
    event loop."""
    raw = await read_body(request, limits.max_body_bytes)
    content_type = request.headers.get("content-type")
    if len(raw) > thread_above_bytes:
        return (*await asyncio.to_thread(_parsed, raw, content_type, model, limits), True)
    return (*_parsed(raw, content_type, model, limits), False)


def _parsed(
    raw: bytes, content_type: str | None, model: type[Model], limits: LimitsConfig
) -> tuple[Any, Model]:
    payload = decoded_payload(raw, content_type, limits.max_json_depth)
    body = validated_body(payload, model)
    check_call_size(body.call_size(), limits)
    return payload, body


def decoded_payload(raw: bytes, content_type: str | None, max_json_depth: int) -> Any:
    """The body decoded as FastAPI reads it for a body parameter: JSON for application/json or +json
    (400 if it does not parse, nests too deeply or holds a lone surrogate or a NUL: proxy/bodies.py), else the
    raw bytes (which then fail validation); NO_BODY if empty."""
    if not raw:
        return NO_BODY
    if not _is_json(content_type):
        return raw
    return decoded_json(raw, max_json_depth)


def check_call_size(size: CallSize, limits: LimitsConfig) -> None:
    """400 naming the field when a valid body asks for more than `limits` allow (proxy/config.py)."""
    if size.prompt_chars > limits.max_prompt_chars:
        raise OpenAIError(
            400, f"Invalid '{size.prompt_param}': too long. Expected at most {limits.max_prompt_chars} "
            f"characters of text, but got {size.prompt_chars} instead.", "invalid_request_error",
            param=size.prompt_param, code="prompt_too_long",
        )
    if size.n > limits.max_n:
        raise _above_max(size.n, limits.max_n, "n")
    if size.top_logprobs > limits.max_top_logprobs:
        raise _above_max(size.top_logprobs, limits.max_top_logprobs, size.top_logprobs_param)
    if size.prompts > limits.max_prompts:
        raise OpenAIError(
            400, f"Invalid '{size.prompt_param}': array too long. Expected at most {limits.max_prompts} "
            f"prompts, but got {size.prompts} instead.", "invalid_request_error", param=size.prompt_param,
            code="array_above_max_length",
        )
    choices = size.n * size.prompts
    if choices > limits.max_choices:
        raise OpenAIError(
            400, f"This call asks for {choices} choices (n × prompts); at most {limits.max_choices} "
            "are allowed in one call.", "invalid_request_error", param="n", code="too_many_choices",
        )


def _above_max(value: int, limit: int, param: str) -> OpenAIError:
    return OpenAIError(
        400, f"Invalid '{param}': integer above maximum value. Expected a value <= {limit}, but got "
        f"{value} instead.", "invalid_request_error", param=param, code="integer_above_max_value",
    )


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
