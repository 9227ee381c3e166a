"""proxy/anthropic/output.py and the Anthropic error shape of proxy/errors.py: stop reasons (a matched stop
sequence read back from the tokens the worker kept), content blocks of a parsed generation, and every
failure as `{"type": "error", "error": {"type", "message"}}` with the status Anthropic's SDK maps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest
from fastapi import Request
from fastapi.exceptions import RequestValidationError

from proxy.anthropic.output import content_blocks, matched_stop, stop_reason
from proxy.errors import OpenAIError, anthropic_error_answer
from proxy.parsers import ParsedOutput, ParsedToolCall
from proxy.workers.plan import ChoiceResult


class Spelling:
    """A tokenizer whose token i spells `pieces[i]`."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = pieces

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in token_ids)


def result(text: str, output_ids: list[int], finish: str = "stop") -> ChoiceResult:
    return ChoiceResult(index=0, text=text, output_ids=output_ids, logprobs=[0.0] * len(output_ids),
                        versions=[0] * len(output_ids), finish_reason=finish, top_logprobs=None,
                        worker_rid=None)


def test_the_stop_sequence_is_found_in_the_tokens_past_the_text() -> None:
    tokenizer = Spelling(["one ", "two ", "ST", "OPx", ""])
    stopped = result("one two ", [0, 1, 2, 3])
    assert matched_stop(stopped, ["OP", "STOP"], tokenizer) == "STOP"  # type: ignore[arg-type]
    assert matched_stop(stopped, ["NEVER"], tokenizer) is None  # type: ignore[arg-type]
    assert matched_stop(result("one two ", [0, 1, 4]), ["STOP"], tokenizer) is None  # type: ignore[arg-type]
    assert matched_stop(result("one two ST", [0, 1, 2], "length"), ["ST"], tokenizer) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("finish", "called", "stop", "expected"),
    [("stop", False, None, "end_turn"), ("stop", True, None, "tool_use"),
     ("stop", False, "X", "stop_sequence"), ("length", True, None, "max_tokens"),
     ("abort", False, None, "end_turn")],
    ids=["end", "tools", "stop-sequence", "budget", "abort"],
)
def test_stop_reasons(finish: str, called: bool, stop: str | None, expected: str) -> None:
    assert stop_reason(finish, called, stop) == expected


def test_blocks_of_a_parsed_generation() -> None:
    parsed = ParsedOutput("Checking.", "hm", [ParsedToolCall("f", '{"a": [1]}')])
    thinking, text, call = content_blocks(parsed)
    assert thinking == {"type": "thinking", "thinking": "hm", "signature": ""}
    assert text == {"type": "text", "text": "Checking."}
    assert call["id"].startswith("toolu_") and (call["name"], call["input"]) == ("f", {"a": [1]})
    assert content_blocks(ParsedOutput(None, None, [])) == []


def _answer(exc: Exception) -> tuple[int, dict[str, object], dict[str, str]]:
    request = Request({"type": "http", "method": "POST", "path": "/v1/messages", "headers": []})
    response = asyncio.run(anthropic_error_answer(request, exc))
    return response.status_code, json.loads(bytes(response.body)), dict(response.headers)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
     (404, "not_found_error"), (409, "invalid_request_error"), (413, "request_too_large"),
     (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
     (529, "overloaded_error")],
    ids=lambda value: str(value),
)
def test_every_refusal_has_anthropics_shape(status: int, kind: str) -> None:
    error = OpenAIError(status, "No.", "invalid_request_error", code="c", headers={"Retry-After": "3"})
    answered, body, headers = _answer(error)
    assert (answered, body) == (status, {"type": "error", "error": {"type": kind, "message": "No."}})
    assert headers["retry-after"] == "3" and headers["content-type"] == "application/json"


def test_a_validation_error_is_an_invalid_request() -> None:
    exc = RequestValidationError([{"type": "missing", "loc": ("body", "max_tokens"),
                                   "msg": "Field required"}])
    status, body, _headers = _answer(exc)
    assert (status, body) == (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}})
