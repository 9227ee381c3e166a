"""A corpus of hostile request bodies: each one, derived from a valid body of a route, is wrong in one way
a careless or malicious client can be wrong, and a sound server refuses every one with a 4xx (never a
5xx or a traceback in its log).

`hostile_bodies(base, ...)` gives, for one route's valid `base` body:
- bytes that are not a JSON document: invalid UTF-8, UTF-8-encoded surrogates, truncated JSON, a form
  body, nesting far deeper than any parser's recursion limit (and just past the proxy's depth limit);
- every string of the body (and a key) replaced by a lone UTF-16 surrogate or a text with a NUL;
- every number replaced by huge ones (beyond any field's range) and by NaN and Infinity literals;
- every top-level field given a value of the wrong type;
- an enormous string (within the body limit) where the route bounds it, given by the caller.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

JSON_TYPE = "application/json"
Path = tuple[str | int, ...]

HUGE_NUMBERS: tuple[Any, ...] = (10**400, -(10**400), 2**70, -(2**70))
"""Integers beyond every numeric field's range (2**70 only where a field is not a free-range float)."""
NON_FINITE = (b"NaN", b"Infinity", b"-Infinity", b"1e999")
BAD_STRINGS = ("\ud800", "x\udfffy", "a\u0000b")
DEEP = 100_000


@dataclass(frozen=True)
class HostileBody:
    name: str
    content: bytes
    content_type: str = JSON_TYPE


def hostile_bodies(
    base: dict[str, Any], *, any_json: frozenset[str] = frozenset(), any_number: frozenset[str] = frozenset(),
    finite_range: frozenset[str] = frozenset(), enormous: tuple[Path, Any] | None = None,
    empty_is_valid: bool = False,
) -> list[HostileBody]:
    """The corpus for one route. `any_json`: top-level fields that take any JSON value (no wrong type
    exists); `any_number`: numbers (by key) in free-form JSON, where any finite number is valid;
    `finite_range`: numeric fields that take any finite float (2**70 is valid there); `enormous`: the
    path and value of an enormous string the route refuses; `empty_is_valid`: an empty body means `{}`
    to the route."""
    bodies = list(_not_json(base))
    if not empty_is_valid:
        bodies.append(HostileBody("empty body", b""))
    for path, value in _leaves(base):
        where = _name(path)
        if isinstance(value, str):
            bodies += [HostileBody(f"{bad!r} in {where}", _encoded(_replaced(base, path, bad)))
                       for bad in BAD_STRINGS]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            huge = [] if path[-1] in any_number else [
                number for number in HUGE_NUMBERS if abs(number) > 2**100 or path[-1] not in finite_range
            ]
            bodies += [HostileBody(f"a {len(str(abs(number)))}-digit number in {where}",
                                   _encoded(_replaced(base, path, number)))
                       for number in huge]
            bodies += [HostileBody(f"{literal.decode()} in {where}", _with_literal(base, path, literal))
                       for literal in NON_FINITE]
    bodies.append(HostileBody("a lone surrogate as a key", _encoded({**base, "\ud800": 1})))
    for field, value in base.items():
        if field in any_json:
            continue
        wrong: Any = [[["x"]]] if isinstance(value, dict) else {"__wrong__": [1]}
        bodies.append(HostileBody(f"wrong type for {field}", _encoded({**base, field: wrong})))
    if enormous is not None:
        path, value = enormous
        bodies.append(HostileBody(f"enormous {_name(path)}", _encoded(_replaced(base, path, value))))
    return bodies


def _not_json(base: dict[str, Any]) -> Iterator[HostileBody]:
    valid = _encoded(base)
    yield HostileBody("invalid UTF-8", valid[:-1] + b', "x": "\xff\xfe\xc3"}')
    yield HostileBody("UTF-8-encoded surrogate", valid[:-1] + b', "x": "\xed\xa0\x80"}')
    yield HostileBody("truncated JSON", valid[: len(valid) // 2])
    yield HostileBody("form body", b"model=m&messages=hi", "application/x-www-form-urlencoded")
    yield HostileBody("JSON null", b"null")
    yield HostileBody("JSON array", b"[1, 2, 3]")
    yield HostileBody(f"arrays {DEEP} deep", b"[" * DEEP + b"]" * DEEP)
    yield HostileBody(f"objects {DEEP} deep", b'{"a":' * DEEP + b"1" + b"}" * DEEP)
    nested: Any = 1
    for _ in range(200):
        nested = {"a": [nested]}
    yield HostileBody("a field 400 levels deep", _encoded({**base, "x": nested}))


def _leaves(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _replaced(base: dict[str, Any], path: Path, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    target: Any = body
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return body


_MARK = "__flywheel_literal__"


def _with_literal(base: dict[str, Any], path: Path, literal: bytes) -> bytes:
    """`base` with the number at `path` written as `literal` (NaN, Infinity: not JSON, so not encodable)."""
    return _encoded(_replaced(base, path, _MARK)).replace(f'"{_MARK}"'.encode(), literal)


def _encoded(body: Any) -> bytes:
    return json.dumps(body).encode()  # ASCII, lone surrogates and NULs as \u escapes


def _name(path: Path) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")
