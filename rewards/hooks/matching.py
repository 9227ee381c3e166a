"""The matching hooks: quick, pure checks of a session's final text against what the agent attached.

- `exact`: the final text (or only its last non-empty line) equals the expected answer, normalised by default
  (stripped, casefolded, whitespace collapsed, a trailing period dropped);
- `regex`: the final text matches a pattern (searched, or matched as a whole); with `answer_key`, the
  pattern's first group (or whole match) must also equal the expected answer;
- `json_schema`: the answer (the last ```json block, else the whole text) is JSON valid against a schema given
  in the arguments or attached to the session.

A session without an expected answer (or schema) gets None: no opinion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Literal

from jsonschema.exceptions import SchemaError, best_match
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rewards.hooks.contract import GroupInput, HookContext, HookFactory, HookLevel, HookResult, SessionInput

SHOWN_CHARS = 500
"""How much of an extracted answer or an error message the details keep."""

_FENCE = re.compile(
    r"^[ \t]*```[ \t]*(?P<info>[^\n`]*)\n(?P<body>.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.MULTILINE | re.DOTALL
)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text, in order, as (info string's first word, lowercased; body).
    A block left open at the end of the text runs to its end."""
    blocks = []
    for match in _FENCE.finditer(text):
        info = match.group("info").strip().split(maxsplit=1)
        blocks.append((info[0].lower() if info else "", match.group("body")))
    return blocks


def _bounded(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def _session(subject: SessionInput | GroupInput, name: str) -> SessionInput:
    if not isinstance(subject, SessionInput):
        raise TypeError(f"{name} is a session hook")
    return subject


def normalize_text(text: str) -> str:
    """Stripped, casefolded, runs of whitespace made one space, and a trailing period dropped."""
    collapsed = " ".join(text.split()).casefold()
    return collapsed[:-1].rstrip() if collapsed.endswith(".") else collapsed


def last_line(text: str) -> str:
    """The last line of `text` that is not blank ("" when none is)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _expected_answers(expected: Any) -> list[str]:
    """The accepted answers: one value, or any of a list of them."""
    values: Iterable[Any] = expected if isinstance(expected, list | tuple) else (expected,)
    return [str(value) for value in values]


class ExactArgs(BaseModel):
    """Arguments of `exact`."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = "answer"
    normalize: bool = True
    last_line: bool = False
    """Compare only the final text's last non-empty line."""
    match_reward: float = 1.0
    mismatch_reward: float = 0.0


class ExactHook:
    """The final text equals the expected answer (or one of a list of them)."""

    level: HookLevel = "session"

    def __init__(self, args: ExactArgs) -> None:
        self.args = args

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        session = _session(subject, "exact")
        expected = session.expected(self.args.answer_key)
        if expected is None:
            return None
        answer = last_line(session.answer_text) if self.args.last_line else session.answer_text
        prepare = normalize_text if self.args.normalize else (lambda text: text)
        matched = prepare(answer) in {prepare(value) for value in _expected_answers(expected)}
        return HookResult(
            session=self.args.match_reward if matched else self.args.mismatch_reward,
            details={"matched": matched, "answer": _bounded(answer)},
        )


class RegexArgs(BaseModel):
    """Arguments of `regex`; the pattern is compiled when the arguments are checked."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    mode: Literal["search", "fullmatch"] = "search"
    ignore_case: bool = False
    answer_key: str | None = None
    """When set, the first group of the match (or the whole match) must equal this expected answer."""
    match_reward: float = 1.0
    mismatch_reward: float = 0.0

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from exc
        return pattern

    def compiled(self) -> re.Pattern[str]:
        """The pattern, compiled with its flags."""
        return re.compile(self.pattern, re.IGNORECASE if self.ignore_case else 0)


def matched_text(match: re.Match[str]) -> str | None:
    """A match's first group, or the whole match when the pattern has no group (None: the group did not
    take part in the match)."""
    return match.group(1) if match.re.groups else match.group(0)


class RegexHook:
    """The final text matches a pattern (and, with `answer_key`, what it captures is the expected answer)."""

    level: HookLevel = "session"

    def __init__(self, args: RegexArgs) -> None:
        self.args = args
        self.pattern = args.compiled()

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        session = _session(subject, "regex")
        expected = None if self.args.answer_key is None else session.expected(self.args.answer_key)
        if self.args.answer_key is not None and expected is None:
            return None
        text = session.answer_text
        match = self.pattern.search(text) if self.args.mode == "search" else self.pattern.fullmatch(text)
        captured = None if match is None else matched_text(match)
        matched = captured is not None and (
            expected is None or captured.strip() in {value.strip() for value in _expected_answers(expected)}
        )
        return HookResult(
            session=self.args.match_reward if matched else self.args.mismatch_reward,
            details={"matched": matched, "match": None if captured is None else _bounded(captured)},
        )


def check_schema(schema: Any) -> dict[str, Any]:
    """`schema` if it is a valid JSON Schema (a JSON text of one is parsed); ValueError naming the problem."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object, not {type(schema).__name__}")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = exc.json_path if exc.path else "the schema"
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from exc
    return schema


class JsonSchemaArgs(BaseModel):
    """Arguments of `json_schema`: the schema itself (`schema`) or the key of one the agent attaches
    (`schema_key`), exactly one of them."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True)

    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    schema_key: str | None = None
    valid_reward: float = 1.0
    invalid_reward: float = 0.0

    @field_validator("json_schema")
    @classmethod
    def _is_a_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if schema is None else check_schema(schema)

    @model_validator(mode="after")
    def _one_source(self) -> JsonSchemaArgs:
        if (self.json_schema is None) == (self.schema_key is None):
            raise ValueError("give exactly one of `schema` and `schema_key`")
        return self


def extract_json_text(text: str) -> str:
    """The last fenced ```json block of `text`, else the whole text, stripped."""
    for info, body in reversed(fenced_blocks(text)):
        if info == "json":
            return body.strip()
    return text.strip()


def validation_error(document: str, schema: dict[str, Any]) -> str | None:
    """Why `document` is not JSON valid against `schema` (the most relevant error), None when it is."""
    try:
        instance = json.loads(document)
    except ValueError as exc:
        return f"not JSON: {exc}"
    validator = validator_for(schema)(schema)
    error = best_match(validator.iter_errors(instance))
    if error is None:
        return None
    return f"at {error.json_path}: {error.message}"


class JsonSchemaHook:
    """The answer is JSON valid against the schema."""

    level: HookLevel = "session"

    def __init__(self, args: JsonSchemaArgs) -> None:
        self.args = args

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        session = _session(subject, "json_schema")
        schema = self.args.json_schema
        if self.args.schema_key is not None:
            attached = session.expected(self.args.schema_key)
            if attached is None:
                return None
            schema = check_schema(attached)
        assert schema is not None
        error = validation_error(extract_json_text(session.answer_text), schema)
        return HookResult(
            session=self.args.valid_reward if error is None else self.args.invalid_reward,
            details={"valid": error is None, "error": None if error is None else _bounded(error)},
        )


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="exact",
        level="session",
        args=ExactArgs,
        build=ExactHook,
        summary="The final text (or its last line) equals the expected answer, normalised by default",
    ),
    HookFactory(
        name="regex",
        level="session",
        args=RegexArgs,
        build=RegexHook,
        summary="The final text matches a regular expression (optionally capturing the expected answer)",
    ),
    HookFactory(
        name="json_schema",
        level="session",
        args=JsonSchemaArgs,
        build=JsonSchemaHook,
        summary="The answer (last ```json block, else the whole text) is JSON valid against a JSON Schema",
    ),
)
