"""Grammars that constrain what a worker may generate, in SGLang's constrained-decoding sampling
parameters (`json_schema`, `regex`, `ebnf`, `structural_tag`): JSON for `response_format`, and forced
tool calls written in a tool-call parser's own format (each parser builds its grammar from these
pieces, so another format can supply its own)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator, SchemaError, validators

ConstraintKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
"""JSON mode (`json_object`) as SGLang sends it; also the arguments of a function without parameters."""


class ConstraintError(ValueError):
    """A constraint the request asks for that cannot be built; `param` is the field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Constraint:
    """One grammar for the worker: the sampling parameter `kind` and its value."""

    kind: ConstraintKind
    text: str


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A function the model may be made to call, with the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def json_constraint(schema: dict[str, Any]) -> Constraint:
    """Output that is one JSON value matching `schema`."""
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a tool-call format writes calls: each call is `opening` (with the function's name where
    `{name}` is, JSON-escaped), the arguments as one JSON object, then `closing`; several calls are
    joined by `separator`."""

    opening: str
    closing: str
    separator: str

    def grammar(self, functions: Sequence[FunctionSpec], *, several: bool) -> Constraint:
        """A `structural_tag` of one call (`several`: one or more) of any of `functions`, each with
        arguments matching its schema, and nothing else.

        A structural tag, not an EBNF: the worker's grammar library turns each JSON schema into
        grammar rules itself (all of JSON Schema it supports, not a subset we would write here)."""
        tags = []
        for function in functions:
            check_schema(function.parameters, f"the parameters of function {function.name!r}", "tools")
            name = json.dumps(function.name, ensure_ascii=False)[1:-1]
            tags.append({"type": "tag", "begin": self.opening.replace("{name}", name),
                         "content": {"type": "json_schema", "json_schema": function.parameters},
                         "end": self.closing})
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not several}
        return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": calls},
                                                       ensure_ascii=False))


def check_schema(schema: dict[str, Any], what: str, param: str) -> None:
    """ConstraintError (blaming `param`) unless `schema` is a valid JSON Schema."""
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        raise ConstraintError(f"Invalid {what}: not a valid JSON Schema: {exc.message}", param) from None


