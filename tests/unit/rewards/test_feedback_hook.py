"""The `feedback` hook: a session's user feedback as one session reward, the mean over its completions of
each one's latest value or thumbs and, with a judge, of comments as a scripted OpenAI-compatible judge
reads them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rewards.hooks.adapters import HookConfigError
from rewards.hooks.contract import FeedbackView, HookContext, HookResult, SessionInput
from rewards.hooks.feedback import FACTORIES
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec
from tests.support.hook_inputs import NoPool, answered, completion_view, hook_context
from tests.support.scripted_judge import JudgeCall, ScriptedJudge

FACTORY = FACTORIES[0]


@pytest.fixture
async def context() -> AsyncIterator[HookContext]:
    async with httpx.AsyncClient() as http:
        yield hook_context(http, NoPool("the feedback hook"))


def with_feedback(*feedback: FeedbackView) -> SessionInput:
    """A three-turn session (c1 "Hello.", c2 "Let me see.", c3 "Paris.") with `feedback`."""
    before = [completion_view("c1", "Hello."), completion_view("c2", "Let me see.")]
    session = answered("Paris.", task="Capital of France?", before=before)
    return SessionInput(
        session_id=session.session_id,
        group_id=None,
        task=session.task,
        metadata=session.metadata,
        completions=session.completions,
        feedback=feedback,
    )


def given(
    completion_id: str = "c3",
    value: float | None = None,
    thumbs: str | None = None,
    comment: str | None = None,
) -> FeedbackView:
    return FeedbackView(completion_id=completion_id, value=value, thumbs=thumbs, comment=comment)


async def labelled(subject: SessionInput, context: HookContext, **args: Any) -> HookResult | None:
    hook = FACTORY.build(FACTORY.args(**args))
    try:
        result = await asyncio.wait_for(hook(subject, context), timeout=30)
    finally:
        await hook.aclose()
    assert result is None or isinstance(result, HookResult)
    return result


async def test_each_completions_latest_value_counts_and_the_mean_is_the_session_reward(
    context: HookContext,
) -> None:
    subject = with_feedback(
        given("c1", 1.0, "up"),
        given("c3", 0.5),
        given("c1", comment="Hmm."),
        given("c3", -1.0, "down", "wrong"),
        given("c2", 0.25),
    )
    result = await labelled(subject, context)
    assert result is not None and not result.completions
    assert result.details["values"] == [1.0, -1.0, 0.25]  # c3's thumbs down replaced its 0.5
    assert result.session == pytest.approx(0.25 / 3)


async def test_without_feedback_that_counts_the_hook_has_no_opinion(context: HookContext) -> None:
    assert await labelled(with_feedback(), context) is None
    assert await labelled(with_feedback(given(comment="Nice.")), context) is None  # no judge to read it


def satisfied(call: JudgeCall) -> str:
    return '{"score": 8, "reason": "pleased"}' if "Exactly what I needed." in call.prompt else "Score: 0"


async def test_a_judge_reads_the_latest_comment_of_completions_without_a_value(context: HookContext) -> None:
    judge = ScriptedJudge(satisfied)
    subject = with_feedback(
        given("c3", 1.0, "up", "Great."),
        given("c3", comment="Not judged: c3 has a value."),
        given("c1", comment="Rude greeting."),
        given("c2", comment="Exactly what I needed."),
        given("c1", comment="A cold greeting."),
    )
    async with judge:
        judge_args = {"base_url": judge.base_url, "api_key": "sk-test", "model": "judge-model"}
        result = await labelled(subject, context, judge=judge_args, comment_min=-1.0, comment_max=1.0)

    prompts = sorted((call.prompt for call in judge.calls), key=lambda prompt: "Exactly" in prompt)
    assert len(prompts) == 2
    assert "A cold greeting." in prompts[0] and "Hello." in prompts[0] and "Rude" not in prompts[0]
    assert "Exactly what I needed." in prompts[1] and "Let me see." in prompts[1]
    assert all("Capital of France?" in prompt and "Not judged" not in prompt for prompt in prompts)
    assert judge.calls[0].body["model"] == "judge-model"
    assert judge.calls[0].headers["Authorization"] == "Bearer sk-test"
    assert result is not None and result.details["values"] == [1.0]
    assert sorted(result.details["judged"]) == [pytest.approx(-1.0), pytest.approx(0.6)]  # 0 and 8 of 10
    assert sorted(result.details["reasons"]) == ["", "pleased"]
    assert result.session == pytest.approx((1.0 + 0.6 - 1.0) / 3)


def test_the_hook_is_built_in_labels_sessions_and_checks_its_args() -> None:
    registry = HookRegistry.built_in()
    assert registry.resolve(HookSpec(hook="feedback"), "session").level == "session"
    with pytest.raises(HookConfigError, match="belongs among the session hooks"):
        registry.resolve(HookSpec(hook="feedback"), "group")
    with pytest.raises(HookConfigError, match="comment_max"):
        registry.resolve(HookSpec(hook="feedback", args={"comment_min": 1, "comment_max": 0}), "session")
    with pytest.raises(HookConfigError, match="judge"):
        registry.resolve(HookSpec(hook="feedback", args={"judge": {"model": "m"}}), "session")
    with pytest.raises(HookConfigError, match="scale"):
        registry.resolve(HookSpec(hook="feedback", args={"scale": 10}), "session")
