"""The matching hooks (`exact`, `regex`, `json_schema`) on real session texts: matches and mismatches,
normalisation, what their arguments refuse (a bad pattern, a bad schema), invalid JSON and schema errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pydantic
import pytest

from rewards.hooks.contract import HookContext, HookResult, SessionInput
from rewards.hooks.matching import (
    FACTORIES,
    JsonSchemaArgs,
    RegexArgs,
    extract_json_text,
    fenced_blocks,
    last_line,
    normalize_text,
)
from tests.support.hook_inputs import NoPool, answered, hook_context

FACTORY = {factory.name: factory for factory in FACTORIES}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


@pytest.fixture
async def context() -> AsyncIterator[HookContext]:
    async with httpx.AsyncClient() as http:
        yield hook_context(http, NoPool("a matching hook"), timeout_s=30.0)


def session(text: str, task: Any = None, **metadata: Any) -> SessionInput:
    """A one-completion session whose answer is `text`."""
    return answered(text, task=task, **metadata)


async def grade(name: str, subject: SessionInput, context: HookContext, **args: Any) -> HookResult | None:
    factory = FACTORY[name]
    hook = factory.build(factory.args(**args))
    assert hook.level == "session"
    result = await hook(subject, context)
    assert result is None or isinstance(result, HookResult)
    return result


async def reward(name: str, subject: SessionInput, context: HookContext, **args: Any) -> float | None:
    """The session reward the hook gives (None: no opinion)."""
    result = await grade(name, subject, context, **args)
    return None if result is None else result.session


def test_factories_are_the_three_session_hooks():
    assert sorted(FACTORY) == ["exact", "json_schema", "regex"]
    assert all(factory.level == "session" and factory.summary for factory in FACTORIES)
    for factory in FACTORIES:
        with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
            factory.args.model_validate({"no_such_field": 1, "pattern": "x", "schema_key": "s"})


def test_normalisation_and_last_line():
    assert normalize_text("  The   Answer\n is  42. ") == "the answer is 42"
    assert normalize_text("STRASSE") == normalize_text("straße")
    assert normalize_text("3.14") == "3.14"
    assert last_line("reasoning...\nAnswer: 7\n\n  \n") == "Answer: 7"
    assert last_line(" \n") == ""


async def test_exact_matches_normalised_text(context: HookContext):
    result = await grade("exact", session("  Paris.\n", answer="paris"), context)
    assert result is not None
    assert result.session == 1.0
    assert result.details["matched"] is True


async def test_exact_mismatch_and_custom_rewards(context: HookContext):
    result = await grade(
        "exact", session("London", answer="Paris"), context, match_reward=2.0, mismatch_reward=-1.0
    )
    assert result is not None
    assert result.session == -1.0
    assert result.details == {"matched": False, "answer": "London"}


async def test_exact_without_normalisation_is_strict(context: HookContext):
    assert await reward("exact", session("paris", answer="Paris"), context, normalize=False) == 0.0
    assert await reward("exact", session("Paris", answer="Paris"), context, normalize=False) == 1.0


async def test_exact_last_line_only(context: HookContext):
    text = "Let me think.\n6 times 7 is...\n42\n"
    assert await reward("exact", session(text, answer="42"), context) == 0.0
    assert await reward("exact", session(text, answer="42"), context, last_line=True) == 1.0


async def test_exact_answer_from_task_numbers_and_lists(context: HookContext):
    assert await reward("exact", session("42", task={"answer": 42}), context) == 1.0
    accepted = session("NYC", answer=["New York", "nyc"])
    assert await reward("exact", accepted, context) == 1.0
    assert await reward("exact", session("42", solution="42"), context, answer_key="solution") == 1.0


async def test_exact_without_expected_answer_has_no_opinion(context: HookContext):
    assert await grade("exact", session("42"), context) is None


def test_regex_args_refuse_a_bad_pattern():
    with pytest.raises(pydantic.ValidationError, match="invalid regular expression: missing \\)"):
        RegexArgs(pattern="(unclosed")
    with pytest.raises(pydantic.ValidationError, match="mode"):
        RegexArgs.model_validate({"pattern": "x", "mode": "match"})


async def test_regex_search_and_fullmatch(context: HookContext):
    text = "The answer is 42."
    assert await reward("regex", session(text), context, pattern=r"\d+") == 1.0
    assert await reward("regex", session(text), context, pattern=r"\d+", mode="fullmatch") == 0.0
    full = await grade("regex", session("42"), context, pattern=r"\d+", mode="fullmatch")
    assert full is not None
    assert full.session == 1.0
    assert full.details == {"matched": True, "match": "42"}


async def test_regex_ignore_case(context: HookContext):
    text = "FINAL ANSWER: yes"
    assert await reward("regex", session(text), context, pattern="final answer") == 0.0
    insensitive = await reward("regex", session(text), context, pattern="final answer", ignore_case=True)
    assert insensitive == 1.0


async def test_regex_captured_group_must_equal_the_expected_answer(context: HookContext):
    args = {"pattern": r"\\boxed\{([^}]*)\}", "answer_key": "answer"}
    right = await grade("regex", session(r"so \boxed{ 42 }", answer="42"), context, **args)
    wrong = await grade("regex", session(r"so \boxed{41}", answer="42"), context, **args)
    absent = await grade("regex", session("no box", answer="42"), context, **args)
    assert right is not None and wrong is not None and absent is not None
    assert (right.session, right.details["match"]) == (1.0, " 42 ")
    assert (wrong.session, wrong.details["match"]) == (0.0, "41")
    assert (absent.session, absent.details["match"]) == (0.0, None)
    no_answer = await grade("regex", session(r"\boxed{42}"), context, **args)
    assert no_answer is None


async def test_regex_whole_match_or_optional_group(context: HookContext):
    whole = await grade("regex", session("x = 42", answer="42"), context, pattern=r"\d+", answer_key="answer")
    assert whole is not None and whole.session == 1.0
    unused_group = await grade("regex", session("answer"), context, pattern=r"answer(: \d+)?")
    assert unused_group is not None and unused_group.details["matched"] is False


def test_json_schema_args_refuse_bad_schemas_and_ambiguity():
    with pytest.raises(pydantic.ValidationError, match=r"invalid JSON schema at \$\.type"):
        JsonSchemaArgs.model_validate({"schema": {"type": "objekt"}})
    with pytest.raises(pydantic.ValidationError, match="invalid JSON schema"):
        JsonSchemaArgs.model_validate({"schema": {"properties": {"age": {"minimum": "zero"}}}})
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        JsonSchemaArgs.model_validate({"schema": PERSON, "schema_key": "schema"})
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        JsonSchemaArgs.model_validate({})
    assert JsonSchemaArgs.model_validate({"schema": PERSON}).model_dump()["schema"] == PERSON


def test_json_answer_extraction():
    text = 'Draft:\n```json\n{"a": 1}\n```\nFinal:\n```json\n{"a": 2}\n```\nDone.'
    assert extract_json_text(text) == '{"a": 2}'
    assert extract_json_text('  {"a": 3}\n') == '{"a": 3}'
    assert extract_json_text("```python\nprint(1)\n```\n") == "```python\nprint(1)\n```"


async def test_json_schema_valid_answer(context: HookContext):
    text = 'Here it is:\n```json\n{"name": "Ada", "age": 36}\n```'
    result = await grade("json_schema", session(text), context, schema=PERSON)
    assert result is not None
    assert result.session == 1.0
    assert result.details == {"valid": True, "error": None}


async def test_json_schema_names_the_error(context: HookContext):
    result = await grade("json_schema", session('{"name": "Ada", "age": -1}'), context, schema=PERSON)
    assert result is not None
    assert result.session == 0.0
    assert result.details["valid"] is False
    assert result.details["error"] == "at $.age: -1 is less than the minimum of 0"
    missing = await grade("json_schema", session('{"name": "Ada"}'), context, schema=PERSON)
    assert missing is not None and "'age' is a required property" in missing.details["error"]


async def test_json_schema_invalid_json(context: HookContext):
    not_json = session("{'name': 'Ada'}")
    result = await grade("json_schema", not_json, context, schema=PERSON, invalid_reward=-0.5)
    assert result is not None
    assert result.session == -0.5
    assert result.details["error"].startswith("not JSON: Expecting property name")


async def test_json_schema_from_the_session(context: HookContext):
    subject = session('{"name": "Ada", "age": 36}', task={"schema": PERSON})
    assert await reward("json_schema", subject, context, schema_key="schema") == 1.0
    as_text = session('{"name": 5, "age": 36}', shape='{"properties": {"name": {"type": "string"}}}')
    result = await grade("json_schema", as_text, context, schema_key="shape")
    assert result is not None and result.details["error"] == "at $.name: 5 is not of type 'string'"
    assert await grade("json_schema", session("{}"), context, schema_key="schema") is None
    with pytest.raises(ValueError, match="invalid JSON schema"):
        await grade("json_schema", session("{}", schema={"type": 3}), context, schema_key="schema")


async def test_long_errors_are_bounded(context: HookContext):
    result = await grade("json_schema", session("[" * 2 + "x" * 5000), context, schema={"type": "array"})
    assert result is not None and len(result.details["error"]) <= 500
    exact = await grade("exact", session("y" * 5000, answer="z"), context)
    assert exact is not None and len(exact.details["answer"]) <= 500


def test_fenced_blocks_keep_order_and_languages():
    text = "a\n```Python title\nx = 1\n```\n```\nbare\n```\n```json\n[1]"
    assert fenced_blocks(text) == [("python", "x = 1\n"), ("", "bare\n"), ("json", "[1]")]
