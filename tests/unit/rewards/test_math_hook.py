"""The `math` hook: answer extraction (pure), and grading with real math-verify in a real process pool,
including a comparison that makes sympy hang, which the pool's hard timeout ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pydantic
import pytest

from rewards.hooks.contract import (
    GroupInput,
    HookContext,
    HookResult,
    HookTimeoutError,
    SessionInput,
)
from rewards.hooks.math import FACTORIES, MathArgs, MathHook, extract_final_answer
from rewards.hooks.pool import ProcessHookPool
from tests.support.hook_inputs import answered, completion_view, hook_context

# Every grading is bounded by this, so a hang fails the test instead of hanging it.
BOUND_S = 60
# 9↑↑5: sympy tries to evaluate it while comparing it with 1 and never comes back.
POWER_TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessHookPool]:
    hook_pool = ProcessHookPool(2, preload=("math_verify",))
    yield hook_pool
    hook_pool.close()


@pytest.fixture
async def context(pool: ProcessHookPool) -> AsyncIterator[HookContext]:
    async with httpx.AsyncClient() as http:
        yield hook_context(http, pool)


def session(text: str, task: Any = None, **metadata: Any) -> SessionInput:
    """A session whose final (trainable) completion says `text`, after an earlier one that says 13."""
    earlier = completion_view("c1", "Let me think: 13.")
    return answered(text, task=task, before=(earlier,), **metadata)


async def grade(context: HookContext, subject: SessionInput, **args: Any) -> HookResult | None:
    """The math hook's result on `subject`, bounded by BOUND_S."""
    result = await asyncio.wait_for(MathHook(MathArgs(**args))(subject, context), BOUND_S)
    assert result is None or isinstance(result, HookResult)
    return result


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 1/2", ("1/2", True)),
        ("She pays 617 + 617 = 1,234 dollars.\n#### 1,234\n", ("1,234", True)),
        ("#### 5\nor maybe\n#### 6", ("5", True)),
        ("####\nthen #### 7", ("7", True)),
        ("\\boxed{1} first, but GSM8K's form wins:\n#### 2", ("2", True)),
        ("\\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", True)),
        ("First \\boxed{\\frac{a}{b}}, last \\boxed{\\frac{\\sqrt{2}}{2}}.", ("\\frac{\\sqrt{2}}{2}", True)),
        ("So $\\boxed{\\frac{a}{b}}$.", ("\\frac{a}{b}", True)),
        ("\\boxed{3}, and a cut-off \\boxed{\\frac{1}{2}", ("3", True)),
        ("\\boxed{\\{1, 2\\}}", ("\\{1, 2\\}", True)),
        ("\\boxed{} \\boxed{ 4 }", ("4", True)),
        ("After all that, the answer is 0.5.", ("0.5", False)),
        ("The answer is 3. Wait.\nThe final answer is: **42**.", ("42", False)),
        ("The answer is $\\frac{1}{2}$ cups", ("$\\frac{1}{2}$ cups", False)),
        ("3 apples and 4 apples make 7 apples.", ("7", False)),
        ("In total it costs $1,234.", ("1,234", False)),
        ("x - 3 = 5, so x = 8", ("8", False)),
        ("It dropped to -3 degrees", ("-3", False)),
        ("Version 2.5 says 10-4", ("4", False)),
        ("I cannot tell.", (None, False)),
        ("", (None, False)),
    ],
)
def test_extract_final_answer(text: str, expected: tuple[str | None, bool]):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("gold", "text", "formatted"),
    [
        ("0.5", "#### 1/2", True),
        ("0.5", "Halving: \\boxed{\\frac{1}{2}}", True),
        ("0.5", "The answer is 0.5", False),
        ("42", "#### 42", True),
        ("42", "#### 42.0", True),
        ("42", "\\boxed{42}", True),
        ("42", "$42$", False),
        ("1234", "#### 1,234", True),
        ("1,234", "The answer is 1234.", False),
        ("18", "#### 18 dollars", True),
        ("\\frac{3}{4}", "The answer is 0.75", False),
    ],
)
async def test_equivalent_answers_are_correct(context: HookContext, gold: str, text: str, formatted: bool):
    result = await grade(context, session(text, answer=gold))
    assert result is not None
    assert result.session == 1.0
    assert result.details["correct"] is True
    assert result.details["formatted"] is formatted
    assert result.details["gold"] == gold


async def test_a_numeric_reference_and_thousands_in_prose(context: HookContext):
    result = await grade(context, session("Altogether they cost $1,234 in total.", answer=1234))
    assert result is not None
    assert result.session == 1.0
    assert result.details == {"predicted": "1,234", "gold": "1234", "correct": True, "formatted": False}


async def test_wrong_answers_score_zero_plus_the_format_bonus(context: HookContext):
    formatted = await grade(context, session("#### 41", answer="42"), format_bonus=0.1)
    assert formatted is not None
    assert formatted.session == pytest.approx(0.1)
    assert formatted.details == {"predicted": "41", "gold": "42", "correct": False, "formatted": True}
    plain = await grade(context, session("The answer is 41.", answer="42"), format_bonus=0.1)
    assert plain is not None
    assert plain.session == 0.0
    assert plain.details["correct"] is False


async def test_a_right_formatted_answer_gets_both_rewards(context: HookContext):
    result = await grade(context, session("\\boxed{42}", answer="42"), format_bonus=0.25, correct_reward=2.0)
    assert result is not None
    assert result.session == pytest.approx(2.25)


async def test_the_reference_key_can_name_a_field_of_the_task(context: HookContext):
    subject = session("#### 7", task={"solution": "7", "answer": "8"})
    result = await grade(context, subject, answer_key="solution")
    assert result is not None
    assert result.session == 1.0
    assert (await grade(context, subject)) == HookResult(
        session=0.0, details={"predicted": "7", "gold": "8", "correct": False, "formatted": True}
    )


async def test_no_reference_means_no_opinion(context: HookContext):
    assert await grade(context, session("#### 42")) is None
    assert await grade(context, session("#### 42", task="a plain-text task")) is None
    assert await grade(context, session("#### 42", answer="  ")) is None


async def test_a_session_that_states_no_answer_scores_zero(context: HookContext):
    metadata = {"answer": "4"}
    subject = SessionInput(session_id="s1", group_id=None, task=None, metadata=metadata, completions=())
    assert await grade(context, subject, format_bonus=0.5) == HookResult(
        session=0.0, details={"predicted": None, "gold": "4", "correct": False, "formatted": False}
    )


async def test_the_hook_labels_sessions_only(context: HookContext):
    group = GroupInput(group_id="g1", task=None, sessions=(session("#### 1", answer="1"),))
    with pytest.raises(TypeError):
        await MathHook(MathArgs())(group, context)


@pytest.mark.slow
async def test_a_comparison_that_hangs_times_out_and_the_pool_grades_the_next_item(context: HookContext):
    with pytest.raises(HookTimeoutError):
        await grade(context, session(POWER_TOWER, answer="1"), timeout_s=2)
    result = await grade(context, session("#### 42", answer="42"), timeout_s=30)
    assert result is not None
    assert result.session == 1.0


def test_the_factory_and_its_arguments():
    (factory,) = FACTORIES
    assert (factory.name, factory.level, factory.args) == ("math", "session", MathArgs)
    hook = factory.build(MathArgs())
    assert isinstance(hook, MathHook)
    assert hook.level == "session"
    assert factory.summary
    defaults = MathArgs()
    assert (defaults.answer_key, defaults.format_bonus, defaults.correct_reward, defaults.timeout_s) == (
        "answer",
        0.0,
        1.0,
        5.0,
    )
    for bad in ({"format_bonus": -0.1}, {"timeout_s": 0}, {"answer": "42"}):
        with pytest.raises(pydantic.ValidationError):
            MathArgs(**bad)
