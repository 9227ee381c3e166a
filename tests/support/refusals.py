"""Reading a proxy's refusals: every error answer has OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, and a 4xx status for what the client did wrong."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.raw_http import RawAnswer

ERROR_FIELDS = {"message", "type", "param", "code"}


def refusal(answer: httpx.Response | RawAnswer, status: int | None = None) -> dict[str, Any]:
    """The `error` object of `answer`, asserting OpenAI's shape, a 4xx status and, if given, `status`."""
    code = answer.status_code if isinstance(answer, httpx.Response) else answer.status
    body = answer.content if isinstance(answer, httpx.Response) else answer.body
    assert 400 <= code < 500, f"HTTP {code}: {body[:500]!r}"
    if status is not None:
        assert code == status, f"HTTP {code}, not {status}: {body[:500]!r}"
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS and isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return dict(error)
