"""proxy/openai/request_body.py answers every bad body exactly as a FastAPI body parameter does (the
OpenAI-shaped 400 of proxy/errors.py): the same app serves both ways and each bad request with a key gets
the same answer. Without a key it is a 401 either way, except that the pipeline never reads the body."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from proxy.config import LimitsConfig
from proxy.errors import OpenAIError, install_error_handlers
from proxy.openai.request_body import parsed_body
from proxy.openai.schemas import ChatCompletionRequest

GOOD = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
JSON = {"content-type": "application/json", "authorization": "Bearer k"}


async def require_key(request: Request) -> None:
    """Stands in for the routes' key check (a dependency)."""
    if "authorization" not in request.headers:
        raise OpenAIError(401, "no key", "authentication_error", code="invalid_api_key")


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    async def by_fastapi(body: ChatCompletionRequest, _key: None = Depends(require_key)) -> dict[str, Any]:
        return body.model_dump(exclude_none=True)

    async def by_hand(request: Request) -> dict[str, Any]:
        await require_key(request)  # the pipeline's order: the key before the body is read
        payload, body, _large = await parsed_body(request, ChatCompletionRequest, LimitsConfig(), 64)
        assert isinstance(payload, dict)
        return body.model_dump(exclude_none=True)

    app.add_api_route("/fastapi", by_fastapi, methods=["POST"])
    app.add_api_route("/hand", by_hand, methods=["POST"])
    return TestClient(app)


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (GOOD, JSON),
        (GOOD, {"content-type": "application/vnd.api+json; charset=utf-8", "authorization": "Bearer k"}),
        (GOOD, {"content-type": "text/plain", "authorization": "Bearer k"}),
        (GOOD, {"authorization": "Bearer k"}),
        (GOOD, {"content-type": "application/json"}),  # no key: 401
        (b"{not json", {"content-type": "application/json"}),  # no key: 401 unread (FastAPI reads it: 400)
        (b"{}", {"content-type": "application/json"}),  # the key before the fields: 401
        (b"", JSON),
        (b"null", JSON),
        (b"{not json", JSON),
        (b"[1, 2]", JSON),
        (b'"text"', JSON),
        (b"{}", JSON),
        (b'{"model": "m", "messages": "hi"}', JSON),
        (b'{"model": "m", "messages": [{"role": "user"}]}', JSON),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 0}', JSON),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', JSON),
        (b'{"model": "m", "messages": [{"role": "nobody", "content": "hi"}]}', JSON),
    ],
)
def test_answers_as_fastapi_does(client: TestClient, content: bytes, headers: dict[str, str]) -> None:
    expected = client.post("/fastapi", content=content, headers=headers)
    answer = client.post("/hand", content=content, headers=headers)
    if "authorization" not in headers:
        assert answer.status_code == 401  # whatever the body: it is never read
        return
    assert (answer.status_code, answer.json()) == (expected.status_code, expected.json())
    if content == GOOD and "json" in headers.get("content-type", ""):
        assert answer.status_code == 200
    else:
        assert answer.status_code == 400
