"""proxy/errors.py: an unexpected error (a bug) is answered with OpenAI's 500 and logged in one line, its
request id, type and message, with the whole trace only at debug level; nothing re-raises it to the server
(which would log the trace again, at error level)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from proxy.errors import install_error_handlers
from proxy.request_context import RequestContextMiddleware


async def broken() -> None:
    raise RuntimeError("the disk is full of bees")


def test_an_unexpected_error_is_one_line_and_a_500(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware)
    app.add_api_route("/broken", broken, methods=["GET"])
    with caplog.at_level(logging.DEBUG, logger="proxy.errors"), TestClient(app) as client:
        answer = client.get("/broken", headers={"x-request-id": "req_bees"})
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "server_error"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "unhandled error on GET /broken (request req_bees): RuntimeError: the disk is full of bees"
    ]
    assert not errors[0].exc_info
    traced = [r for r in caplog.records if r.exc_info]
    assert [r.levelno for r in traced] == [logging.DEBUG]
