"""How the demo agent turns what the proxy's `math` reward hook left on a session into its attempt's
reward, and how it names the hook when it creates a group."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from integrations.gsm8k.agent import HOOK_SOURCE, AgentSettings, Attempt, GroupResult, graded_by_hook
from integrations.gsm8k.loop import summarize_round
from integrations.gsm8k.problems import generate_problems
from integrations.gsm8k.rl_api import unsettled_hooks

ANSWERED = Attempt("s1", "It is 7.\n#### 7", None, False, False, None)


def view(jobs: list[dict[str, Any]], rewards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"session_id": "s1", "hooks": jobs, "rewards": rewards}


def hook_reward(value: float, **details: Any) -> dict[str, Any]:
    return {"value": value, "source": HOOK_SOURCE, "completion_id": None, "details": details}


def test_the_hooks_reward_and_findings_become_the_attempts() -> None:
    graded = graded_by_hook(ANSWERED, view(
        [{"source": HOOK_SOURCE, "state": "done", "error": None}],
        [{"value": 0.5, "source": "gsm8k", "completion_id": None, "details": {}},
         hook_reward(1.1, predicted="7", gold="7", correct=True, formatted=True, raw=1.1, weight=1.0)],
    ))
    assert (graded.reward, graded.predicted, graded.correct, graded.formatted) == (1.1, "7", True, True)
    assert graded.grading_error is None and graded.text == ANSWERED.text


def test_a_failed_hook_leaves_the_attempt_unrewarded_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    failed = {"source": HOOK_SOURCE, "state": "failed", "error": "HookTimeoutError: math-verify hung"}
    with caplog.at_level(logging.WARNING, logger="integrations.gsm8k.agent"):
        graded = graded_by_hook(ANSWERED, view([failed], []))
    assert graded.reward is None and not graded.correct
    assert graded.grading_error is not None and "math-verify hung" in graded.grading_error
    assert "s1" in caplog.text and "math hook failed" in caplog.text


@pytest.mark.parametrize(("jobs", "problem"), [
    ([], "has no math hook"),
    ([{"source": HOOK_SOURCE, "state": "done", "error": None}], "gave no reward"),
])
def test_a_session_the_hook_did_not_label_is_unrewarded(jobs: list[dict[str, Any]], problem: str) -> None:
    # A per-completion reward of the hook is not the session's.
    per_completion = {**hook_reward(1.0), "completion_id": "c1"}
    graded = graded_by_hook(ANSWERED, view(jobs, [per_completion]))
    assert graded.reward is None and graded.grading_error is not None and problem in graded.grading_error


def test_unsettled_hooks_are_the_queued_and_running_ones() -> None:
    jobs = [{"source": HOOK_SOURCE, "state": "running"}, {"source": "hook:judge", "state": "queued"},
            {"source": "hook:x", "state": "done"}, {"source": "hook:y", "state": "failed"}]
    assert [j["source"] for j in unsettled_hooks({"hooks": jobs})] == [HOOK_SOURCE, "hook:judge"]
    assert [j["source"] for j in unsettled_hooks({"hooks": jobs}, [HOOK_SOURCE])] == [HOOK_SOURCE]
    assert unsettled_hooks({"hooks": []}) == []


def test_groups_name_the_math_hook_unless_the_agent_rewards_over_rest() -> None:
    assert AgentSettings(model="m", format_bonus=0.3).reward_hooks() == {
        "hook": "math", "args": {"format_bonus": 0.3}}
    assert AgentSettings(model="m", grading="rest").reward_hooks() == []
    with pytest.raises(ValueError, match="grading"):
        AgentSettings(model="m", grading="judge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hook_timeout_s"):
        AgentSettings(model="m", hook_timeout_s=0)


def test_a_round_counts_attempts_the_hook_left_unrewarded_apart() -> None:
    problem = generate_problems(1, seed=3)[0]
    group = GroupResult("g1", problem, [
        Attempt("a", "#### 1", "1", True, True, 1.1),
        Attempt("b", "#### 2", "2", False, True, 0.1),
        Attempt("c", "?", None, False, False, None, grading_error="the math hook failed: boom"),
        Attempt("d", "", None, False, False, None, error="APITimeoutError: timed out"),
    ])
    result = summarize_round(0, [group], 1.0)
    assert (result.attempts, result.failed, result.ungraded) == (4, 1, 1)
    assert result.mean_reward == pytest.approx(0.6)
