"""Request bodies of every POST route, the OpenAI surface's and the RL API's: read under
`proxy.limits.max_body_bytes`, decoded as JSON and checked for what would otherwise fail deep inside the
proxy, and declared in the OpenAPI document.

- A route reads its body only once the caller's key is checked, so a request with a bad key is refused
  before a byte of its body is read.
- `read_body` refuses a body over the limit from its Content-Length, before reading it, and otherwise
  (a chunked upload) as soon as what it read passes the limit: nothing beyond it is ever buffered.
- `decoded_json` refuses, as 400s, what a JSON parser accepts but the proxy cannot use: nesting deeper
  than `proxy.limits.max_json_depth` (recursive code further on would fail on it), lone UTF-16
  surrogates (`"\\ud800"`: not Unicode text) and NUL characters (`"\\u0000"`), neither of which Postgres
  stores, in a JSON column or a text one. They are refused on SQLite too: a request is valid or not
  whatever the database.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from contextlib import aclosing
from typing import Any, Final

import msgspec
from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from proxy.errors import OpenAIError

_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")
"""Any surrogate code point in a `str`: a decoded valid pair is one astral character, never two."""
_ESCAPED_NUL: Final = b"\\u0000"  # the only way JSON can carry a NUL character
_MAX_LENGTH_DIGITS: Final = 18  # a Content-Length of more digits is over any limit (and int() may refuse it)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, read incrementally; 413 `request_too_large` once it is known to be longer
    than `max_bytes` (from its Content-Length before reading, else while reading)."""
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and (len(declared) > _MAX_LENGTH_DIGITS or int(declared) > max_bytes):
        raise body_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        if declared.isdigit():  # the server delivers no more than the declared length: read it whole
            return await request.body()
        async with aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes:
                    raise body_too_large(max_bytes)
                chunks.append(chunk)
    except ClientDisconnect:
        raise OpenAIError(
            400, "The client disconnected before sending the whole request body.", "invalid_request_error",
            code="incomplete_body",
        ) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decoded_json(raw: bytes, max_depth: int, *, non_finite: bool = False) -> Any:
    """`raw` as JSON, checked by `check_json`; 400 `invalid_json` if it does not parse (invalid UTF-8,
    a number out of range) or holds a lone surrogate or a NUL, 400 `json_too_deep` if it nests too
    deeply.

    By default msgspec decodes it, which refuses NaN and Infinity (not JSON) and lone surrogates itself,
    so its strings are scanned only when the raw body holds an escaped NUL. `non_finite` reads it with
    Python's parser instead, which takes NaN and Infinity as floats, for APIs that refuse them at
    validation, naming the field (the RL API: a 422)."""
    try:
        value = json.loads(raw) if non_finite else msgspec.json.decode(raw)
    except RecursionError:  # deeper than the parser's own limit, far beyond max_depth
        raise json_too_deep(max_depth) from None
    except ValueError:  # msgspec.DecodeError, json.JSONDecodeError, UnicodeDecodeError
        raise invalid_json() from None
    strings = non_finite or _ESCAPED_NUL in raw
    # Nesting cannot be deeper than the body has `[` and `{` (in strings or not): counted at C speed,
    # that spares most bodies the walk.
    if strings or raw.count(b"[") + raw.count(b"{") > max_depth:
        check_json(value, max_depth, strings=strings)
    return value


def check_json(value: Any, max_depth: int, *, strings: bool = True) -> None:
    """400 if decoded JSON nests arrays and objects more than `max_depth` deep or, with `strings`, holds
    a lone surrogate or a NUL in a key or a string. One pass, level by level (no recursion, so no depth
    can overflow it); strings are scanned at C speed, an ASCII one only for NUL."""
    level = [value] if isinstance(value, dict | list) else []
    if strings and isinstance(value, str):
        _check_text(value)
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise json_too_deep(max_depth)
        inner: list[Any] = []
        for node in level:
            items: Iterable[Any] = node
            if type(node) is dict:
                if strings:
                    for key in node:
                        _check_text(key)
                items = node.values()
            for item in items:
                kind = type(item)
                if kind is dict or kind is list:
                    inner.append(item)
                elif strings and kind is str:
                    _check_text(item)
        level = inner


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise invalid_json("it holds a NUL character (\\u0000), which cannot be stored")
    if not text.isascii() and _LONE_SURROGATE.search(text) is not None:
        raise invalid_json("it holds a lone UTF-16 surrogate, which is not Unicode text")


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON with non-ASCII characters escaped (as a JSON column stores it);
    ValueError if it holds NaN or an infinity, which JSON cannot."""
    return len(json.dumps(value, allow_nan=False, separators=(",", ":")))


def body_too_large(max_bytes: int, param: str | None = None, what: str = "The request body") -> OpenAIError:
    return OpenAIError(
        413, f"{what} is too large: the limit is {max_bytes} bytes.", "invalid_request_error", param=param,
        code="request_too_large",
    )


def invalid_json(detail: str | None = None) -> OpenAIError:
    reason = f": {detail}" if detail else ""
    return OpenAIError(
        400, f"We could not parse the JSON body of your request{reason}.", "invalid_request_error",
        code="invalid_json",
    )


def json_too_deep(max_depth: int) -> OpenAIError:
    return OpenAIError(
        400, f"The JSON body nests arrays and objects more than {max_depth} levels deep.",
        "invalid_request_error", code="json_too_deep",
    )


def openapi_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` declaring `model` as the JSON body of a route that reads its body by hand (FastAPI
    documents only declared body parameters). The model's schema is inlined, its definitions resolved
    in place (the document's components list only the models FastAPI saw; no body model is recursive)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    content = {"application/json": {"schema": _inline(schema, definitions)}}
    return {"requestBody": {"required": required, "content": content}}


def _inline(schema: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(schema, list):
        return [_inline(item, definitions) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        rest = {key: value for key, value in schema.items() if key != "$ref"}
        definition = definitions[ref.removeprefix("#/$defs/")]
        return {**_inline(definition, definitions), **_inline(rest, definitions)}
    return {key: _inline(value, definitions) for key, value in schema.items()}
