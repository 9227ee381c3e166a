"""proxy/bodies.py: a body is read only up to the limit (from its Content-Length before any of it, else
as it arrives), decoded JSON is refused when it nests too deeply or holds what no database stores (lone
surrogates, NULs), and a hand-read body is declared in the OpenAPI document with its model's schema."""

from __future__ import annotations

import math
from typing import Any

import pytest
from starlette.requests import Request

from proxy.bodies import check_json, decoded_json, openapi_body, read_body
from proxy.errors import OpenAIError
from proxy.openai.schemas import ChatCompletionRequest
from proxy.rl.schemas import CreateSessionRequest


def _request(chunks: list[bytes], headers: dict[str, str]) -> tuple[Request, list[int]]:
    """A request whose body arrives in `chunks`, and the count of chunks the app asked for."""
    asked = [0]

    async def receive() -> dict[str, Any]:
        index = asked[0]
        asked[0] += 1
        assert index < len(chunks), "read past the last chunk"
        return {"type": "http.request", "body": chunks[index], "more_body": index < len(chunks) - 1}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    return Request(scope, receive), asked


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    request, asked = _request([b"x" * 10], {"content-length": "2000"})
    with pytest.raises(OpenAIError) as refused:
        await read_body(request, 1024)
    assert (refused.value.status, refused.value.code) == (413, "request_too_large")
    assert asked == [0]
    absurd, asked = _request([b""], {"content-length": "9" * 5000})
    with pytest.raises(OpenAIError):
        await read_body(absurd, 1024)
    assert asked == [0]


async def test_an_undeclared_body_is_read_only_until_it_passes_the_limit() -> None:
    request, asked = _request([b"x" * 400] * 100, {})
    with pytest.raises(OpenAIError) as refused:
        await read_body(request, 1024)
    assert refused.value.status == 413
    assert asked == [3]  # 1200 bytes read: the limit passed, nothing more asked for
    fits, _ = _request([b"ab", b"cd", b""], {})
    assert await read_body(fits, 1024) == b"abcd"


def _nested(depth: int) -> Any:
    value: Any = 0
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def test_depth_is_counted_in_arrays_and_objects() -> None:
    check_json(_nested(8), 8)
    check_json("text", 1)
    with pytest.raises(OpenAIError) as deep:
        check_json(_nested(9), 8)
    assert (deep.value.status, deep.value.code) == (400, "json_too_deep")


@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb", "x\x00y"])
def test_lone_surrogates_and_nuls_are_refused_in_strings_and_keys(bad: str) -> None:
    for value in ({"k": [1, {"deep": bad}]}, {bad: 1}, bad):
        with pytest.raises(OpenAIError) as refused:
            check_json(value, 8)
        assert (refused.value.status, refused.value.code) == (400, "invalid_json")
    check_json({"k": bad}, 8, strings=False)  # msgspec never decodes a lone surrogate


def test_valid_text_passes() -> None:
    check_json({"emoji 😀": ["日本語", "ascii", "é"]}, 8)


@pytest.mark.parametrize(
    "raw",
    [b'{"a": "\xff"}', b'{"a": "\xed\xa0\x80"}', b'{"a": "\\ud800"}', b'{"a": "\\u0000"}', b'{"a": NaN}',
     b'{"a": 1e999}', b"{", b"[" * 100_000 + b"]" * 100_000],
)
def test_decoding_refuses_what_the_proxy_cannot_use(raw: bytes) -> None:
    with pytest.raises(OpenAIError) as refused:
        decoded_json(raw, 64)
    assert refused.value.status == 400 and refused.value.code in ("invalid_json", "json_too_deep")


def test_python_decoding_reads_non_finite_numbers_but_refuses_the_rest() -> None:
    value = decoded_json(b'{"a": [NaN, Infinity], "b": 1e999}', 64, non_finite=True)
    assert math.isnan(value["a"][0]) and value["b"] == math.inf
    for raw in (b'{"a": "\\ud800"}', b'{"\\u0000": 1}', b'{"a": "\xff"}', b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(OpenAIError):
            decoded_json(raw, 64, non_finite=True)


def test_an_openapi_body_is_the_models_schema_inlined() -> None:
    declared = openapi_body(ChatCompletionRequest)["requestBody"]
    assert declared["required"] is True
    schema = declared["content"]["application/json"]["schema"]
    assert "$ref" not in str(schema) and "$defs" not in schema
    assert "content" in schema["properties"]["messages"]["items"]["properties"]
    assert openapi_body(CreateSessionRequest, required=False)["requestBody"]["required"] is False
