"""The pure parts of reward hooks: specs, how user functions' shapes are told apart and their answers read,
a hook's answer as reward rows, how client and hook rewards combine, the registry's refusals, and the
runner's backoff."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from rewards.config import HookRunnerConfig
from rewards.finalize import RewardEntry, combine_rewards
from rewards.hooks.adapters import HookConfigError, coerce_result, detect_shape
from rewards.hooks.contract import GroupInput, GroupResult, HookResult, SessionInput
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec, parse_specs, stored_hooks
from rewards.labels import reward_rows
from rewards.runner import retry_delay
from tests.support.hook_inputs import completion_view


def session(session_id: str = "s1", *completion_ids: str) -> SessionInput:
    completions = tuple(completion_view(cid, cid) for cid in completion_ids or ("c1",))
    return SessionInput(session_id=session_id, group_id=None, task={"answer": "7"}, metadata={},
                        completions=completions)


def test_specs_take_one_object_a_list_or_hooks_and_name_their_source() -> None:
    assert parse_specs({"hook": "math"}) == [HookSpec(hook="math")]
    assert parse_specs([{"hook": "math"}, {"hook": "exact", "name": "e"}])[1].source == "hook:e"
    assert parse_specs({"hooks": [{"hook": "math"}]}) == [HookSpec(hook="math")]
    assert parse_specs(None) == []
    with pytest.raises(ValidationError, match="shorter `name`"):
        HookSpec(hook="a.very.long.package.path.to.some.module:with_a_long_function_name_too")
    with pytest.raises(ValidationError):
        HookSpec(hook="math", weight=float("nan"))
    with pytest.raises(ValidationError):
        HookSpec(hook="math", unknown=1)  # type: ignore[call-arg]
    stored = stored_hooks([HookSpec(hook="math", max_attempts=7), HookSpec(hook="exact")], 3)
    assert stored == [{"source": "hook:math", "max_attempts": 7, "spec": {"hook": "math", "max_attempts": 7}},
                      {"source": "hook:exact", "max_attempts": 3, "spec": {"hook": "exact"}}]
    assert stored_hooks([], 3) is None


def trl(prompts: Any, completions: Any, completion_ids: Any, **kwargs: Any) -> list[float]:
    return [0.0]


def verl(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    return 0.0


def areal(
    prompt: Any, completions: Any, prompt_ids: Any, completion_ids: Any, answer: Any, **kw: Any
) -> float:
    return 0.0


def native(session: SessionInput) -> float:
    return 0.0


def test_shapes_are_told_apart_by_parameter_names() -> None:
    assert [detect_shape(fn) for fn in (trl, verl, areal, native)] == ["trl", "verl", "areal", "native"]


def test_what_a_user_function_returns_becomes_a_hook_result() -> None:
    one = session()
    assert coerce_result(0.5, one) == HookResult(session=0.5)
    assert coerce_result([1], one) == HookResult(session=1.0)  # TRL: a batch of one
    assert coerce_result(None, one) is None
    assert coerce_result([None], one) is None
    assert coerce_result({"score": 2, "acc": True}, one) == HookResult(session=2.0, details={"acc": True})
    for bad in (True, "1", float("inf"), [1, 2], {"acc": 1}):
        with pytest.raises((TypeError, ValueError)):
            coerce_result(bad, one)
    group = GroupInput(group_id="g", task=None, sessions=(session("a"), session("b")))
    assert coerce_result([1.0, None], group) == GroupResult(sessions={"a": HookResult(session=1.0)})
    with pytest.raises(ValueError, match="2 sessions"):
        coerce_result([1.0], group)


def test_a_hooks_answer_becomes_weighted_rows_for_its_own_session_only() -> None:
    subject = session("s1", "c1", "c2")
    rows, summary = reward_rows(HookResult(session=1.0, completions={"c2": -1.0}, details={"why": "x"}),
                                subject, weight=0.5)
    assert [(r.value, r.session_id, r.completion_id, r.details) for r in rows] == [
        (0.5, "s1", None, {"why": "x", "raw": 1.0, "weight": 0.5}),
        (-0.5, None, "c2", {"why": "x", "raw": -1.0, "weight": 0.5}),
    ]
    assert summary == {"opinion": True, "rewards": 2, "session": 1.0}
    assert reward_rows(None, subject, 1.0) == ([], {"opinion": False})
    with pytest.raises(ValueError, match="not in session"):
        reward_rows(HookResult(completions={"elsewhere": 1.0}), subject, 1.0)
    group = GroupInput(group_id="g", task=None, sessions=(session("a"),))
    with pytest.raises(ValueError, match="not in group"):
        reward_rows(GroupResult(sessions={"z": HookResult(session=1.0)}), group, 1.0)
    with pytest.raises(TypeError):
        reward_rows(HookResult(session=1.0), group, 1.0)


def entries(*rows: tuple[float, str]) -> list[RewardEntry]:
    return [RewardEntry(value=value, source=source) for value, source in rows]


@pytest.mark.parametrize(("rule", "expected"), [("rest_wins", 5.0), ("hooks_win", 1.5), ("sum", 6.5)])
def test_client_and_hook_rewards_combine_by_the_rule(rule: Any, expected: float) -> None:
    mixed = entries((9.0, "rest"), (5.0, "rest"), (1.0, "hook:a"), (0.5, "hook:b"))
    assert combine_rewards(mixed, rule).session == expected
    assert combine_rewards(entries((1.0, "hook:a"), (0.5, "hook:b")), rule).session == 1.5
    assert combine_rewards(entries((2.0, "rest"), (1.0, "verifier")), rule).session == 3.0


def test_the_registry_refuses_what_cannot_run_and_suggests_the_nearest_name() -> None:
    registry = HookRegistry.built_in()
    with pytest.raises(HookConfigError, match="did you mean 'math'"):
        registry.resolve(HookSpec(hook="maths"), "session")
    with pytest.raises(HookConfigError, match="belongs among the group hooks"):
        registry.resolve(HookSpec(hook="group_ranking", args={"base_url": "http://x", "model": "m",
                                                              "api_key": "k"}), "session")
    with pytest.raises(HookConfigError, match="format_bonus"):
        registry.resolve(HookSpec(hook="math", args={"format_bonus": -1}), "session")
    with pytest.raises(HookConfigError, match="cannot import"):
        registry.resolve(HookSpec(hook="no_such_package.grading:score"), "session")
    with pytest.raises(HookConfigError, match="labels one session"):
        registry.resolve(HookSpec(hook=f"{__name__}:verl", name="v"), "group")
    with pytest.raises(HookConfigError, match="`adapter` is for user functions"):
        registry.resolve(HookSpec(hook="math", adapter="trl"), "session")
    with pytest.raises(HookConfigError, match="distinct `name`"):
        registry.check([HookSpec(hook="math"), HookSpec(hook="math", args={"format_bonus": 0.1})], "session")
    math = HookSpec(hook="math")
    assert registry.resolve(math, "session") is registry.resolve(math, "session")  # built once


def test_retries_back_off_doubling_up_to_the_cap() -> None:
    config = HookRunnerConfig(backoff_s=2.0, backoff_max_s=10.0)
    assert [retry_delay(attempt, config) for attempt in (1, 2, 3, 4, 50)] == [2.0, 4.0, 8.0, 10.0, 10.0]
