"""A hot route's request headers (proxy/hot_routes.py `IndexedHeaders`): looked up through a dict, they
answer exactly as Starlette's own headers do, repeated and differently cased names included."""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers

from proxy.hot_routes import HotRequest, IndexedHeaders

RAW = [
    (b"authorization", b"Bearer first"),
    (b"content-type", b"application/json"),
    (b"authorization", b"Bearer second"),
    (b"x-empty", b""),
]


def _scope() -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(RAW)}


def test_lookups_answer_as_starlettes_headers() -> None:
    ours, theirs = IndexedHeaders(_scope()), Headers(scope=_scope())
    for name in ("authorization", "Authorization", "CONTENT-TYPE", "x-empty", "missing"):
        assert ours.get(name) == theirs.get(name)
        assert ours.get(name, "default") == theirs.get(name, "default")
        assert (name in ours) == (name in theirs)
    assert ours["Authorization"] == "Bearer first"  # the first of repeated headers
    assert ours.getlist("authorization") == ["Bearer first", "Bearer second"]
    assert ours.items() == theirs.items() and len(ours) == len(theirs)
    assert 42 not in ours


def test_a_hot_request_indexes_its_headers_once() -> None:
    request = HotRequest(_scope())
    assert isinstance(request.headers, IndexedHeaders)
    assert request.headers is request.headers
    assert request.headers["content-type"] == "application/json"
