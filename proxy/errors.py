"""OpenAI-shaped errors: `OpenAIError` for our own refusals, and the app's exception handlers that render
every failure (ours, FastAPI's validation, Starlette's HTTP errors, unexpected bugs) as
`{"error": {"message", "type", "param", "code"}}` with the status the `openai` client maps. The Messages
API's routes answer the same failures in Anthropic's shape instead (`anthropic_error_answer`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from storage.errors import is_unavailable

logger = logging.getLogger(__name__)

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "conflict_error",
    "rate_limit_error",
    "server_error",
]

REQUEST_ID_HEADER = "x-request-id"

_TYPE_BY_STATUS: dict[int, ErrorType] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI words unknown URLs and models as invalid requests
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


_ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class OpenAIError(Exception):
    """A refusal rendered as OpenAI renders it. `headers` are added to the response."""

    def __init__(
        self,
        status: int,
        message: str,
        type: ErrorType,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def unavailable_error(retry_after_s: float) -> OpenAIError:
    """The 503 of work refused or failed because the database is down (proxy/database.py)."""
    seconds = max(1, math.ceil(retry_after_s))
    return OpenAIError(
        503, f"The database is unavailable; retry in {seconds} s.", "server_error",
        code="database_unavailable", headers={"Retry-After": str(seconds)},
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The JSON object OpenAI answers (and streams) for an error."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status: int, body: dict[str, Any], request: Request, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer; its `x-request-id` is added by the request context (proxy/request_context.py),
    which wraps every route, as it is to every answer."""
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app can raise in OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(UnexpectedErrors)


class UnexpectedErrors:
    """Answers an exception no handler took (a bug) with the 500 of `_unexpected_error`, which logs it in
    one line. Starlette's outermost middleware would answer it too, but then re-raises it to the server,
    which logs its whole trace at error level for every such request. An exception after the answer
    started cannot be answered any more; it goes on to the server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:
            if started:
                raise
            response = await _unexpected_error(Request(scope, receive), exc)
            await response(scope, receive, send)


async def error_answer(request: Request, exc: Exception) -> Response:
    """What the handlers `install_error_handlers` installs answer for `exc`, for a route served outside
    FastAPI's middleware (proxy/hot_routes.py)."""
    if isinstance(exc, OpenAIError):
        return await _openai_error(request, exc)
    if isinstance(exc, RequestValidationError):
        return await _validation_error(request, exc)
    if isinstance(exc, StarletteHTTPException):
        return await _http_error(request, exc)
    return await _unexpected_error(request, exc)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """The JSON object Anthropic answers (and streams as an `error` event) for an error."""
    kind = _ANTHROPIC_TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def anthropic_error_answer(request: Request, exc: Exception) -> Response:
    """`error_answer` in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`: the same
    message, status (a 422 is a 400, as Anthropic words every invalid request) and headers."""
    answer = await error_answer(request, exc)
    message = str(msgspec.json.decode(answer.body)["error"]["message"])
    status = 400 if answer.status_code == 422 else answer.status_code
    headers = {name: value for name, value in answer.headers.items()
               if name not in ("content-length", "content-type")}
    return error_response(status, anthropic_error_body(status, message), request, headers)


async def _openai_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.status, exc.body(), request, exc.headers)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param, code = describe_validation_errors(exc.errors())
    return error_response(400, error_body(message, "invalid_request_error", param, code), request)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    error_type = _TYPE_BY_STATUS.get(exc.status_code, "server_error" if exc.status_code >= 500 else
                                     "invalid_request_error")
    if exc.status_code in (404, 405):
        message = f"Invalid URL ({request.method} {request.url.path})"
        code = "unknown_url" if exc.status_code == 404 else "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return error_response(exc.status_code, error_body(message, error_type, None, code), request, exc.headers)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    if is_unavailable(exc):
        return _database_down(request, exc)
    # One line per failure, its type and message; the trace only at debug level, so that a route failing
    # for every request cannot flood the log.
    request_id = getattr(request.state, "request_id", "-")
    logger.error("unhandled error on %s %s (request %s): %s: %s", request.method, request.url.path,
                 request_id, type(exc).__name__, exc)
    logger.debug("unhandled error of request %s", request_id, exc_info=exc)
    body = error_body("The server had an error while processing your request.", "server_error")
    return error_response(500, body, request)


def _database_down(request: Request, exc: Exception) -> Response:
    """503 with Retry-After for work that met a database that is down; the app's circuit opens."""
    database: Any = getattr(getattr(request.app.state, "services", None), "database", None)
    if database is not None:
        database.failed(exc)
    error = unavailable_error(database.retry_after_s if database is not None else 1.0)
    logger.warning("%s %s: database unavailable (request %s): %s: %s", request.method, request.url.path,
                   getattr(request.state, "request_id", "-"), type(exc).__name__, exc)
    return error_response(error.status, error.body(), request, error.headers)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic/FastAPI validation errors, naming the first bad field as
    OpenAI does (`messages[0].content`)."""
    if not errors:
        return "Invalid request body.", None, "invalid_request"
    # In a union pydantic reports one error per branch; the deepest one says what went wrong.
    first = max(errors, key=lambda error: len(error.get("loc", ())))
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _param_name(loc) or None
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request.", None, "invalid_json"
    if kind == "missing":
        if param is None:  # the body itself
            return "Missing the request body: send a JSON object.", None, "missing_required_parameter"
        return f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
    detail = str(first.get("msg", "invalid value"))
    where = f"'{param}'" if param else "the request body"
    if kind.endswith("_type") or kind in ("model_type", "model_attributes_type", "dict_type", "list_type"):
        return f"Invalid type for {where}: {detail}.", param, "invalid_type"
    return f"Invalid value for {where}: {detail}.", param, "invalid_value"


_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "None"})


def _param_name(loc: Sequence[Any]) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif _is_union_branch(str(part)):
            continue  # pydantic names the union branch it tried in the location; OpenAI does not
        elif not name:
            name = str(part)
        else:
            name += f".{part}"
    return name


def _is_union_branch(part: str) -> bool:
    return part in _BRANCH_NAMES or "[" in part or part[:1].isupper()
