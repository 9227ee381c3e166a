"""The LLM judge hooks (`judge`, `group_ranking`, `next_state`) against a scripted OpenAI-compatible judge:
what each judge is shown, how its answers become rewards, how many calls it makes, and its bounds."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import openai
import pydantic
import pytest

from rewards.hooks import contract
from rewards.hooks import judge_prompts as prompts
from rewards.hooks.contract import CompletionView, GroupInput, HookContext, SessionInput
from rewards.hooks.judge import FACTORIES, JudgeAnswerError, JudgeConfigError
from tests.support.hook_inputs import NoPool, hook_context
from tests.support.scripted_judge import Failure, JudgeCall, ScriptedJudge, in_order

TASK = "What is 6 times 7?"
FACTORY = {factory.name: factory for factory in FACTORIES}


@pytest.fixture
async def context() -> AsyncIterator[HookContext]:
    async with httpx.AsyncClient() as http:
        yield hook_context(http, NoPool("a judge hook"))


def build(name: str, **args: Any) -> Any:
    """A hook built by factory name from keyword args, as the registry would."""
    factory = FACTORY[name]
    args.setdefault("api_key", "sk-test")
    args.setdefault("model", "judge-model")
    return factory.build(factory.args(**args))


async def judged(judge: ScriptedJudge, name: str, subject: Any, context: HookContext, **args: Any) -> Any:
    """Hook `name`'s answer on `subject`, asking `judge` (served for the call)."""
    async with judge:
        hook = build(name, base_url=judge.base_url, **args)
        try:
            return await asyncio.wait_for(hook(subject, context), timeout=30)
        finally:
            await hook.aclose()


def completion(
    cid: str,
    messages: Sequence[dict[str, Any]],
    content: str,
    *,
    parent_id: str | None = None,
    trainable: bool = True,
    tool_calls: list[dict[str, Any]] | None = None,
) -> CompletionView:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return CompletionView(
        id=cid, parent_id=parent_id, messages=tuple(messages), message=message, text=content,
        prompt_ids=(1, 2, 3), output_ids=(4, 5), finish_reason="stop", trainable=trainable,
    )


def session(
    sid: str, completions: Sequence[CompletionView], *, metadata: dict[str, Any] | None = None
) -> SessionInput:
    return SessionInput(
        session_id=sid, group_id="g", task=TASK, metadata=metadata or {}, completions=tuple(completions)
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def answered(sid: str, answer: str, *, reference: str | None = None) -> SessionInput:
    """A one-turn session answering TASK."""
    metadata = {} if reference is None else {"answer": reference}
    messages = [{"role": "system", "content": "Be brief."}, user(TASK)]
    return session(sid, [completion(f"{sid}-c0", messages, answer)], metadata=metadata)


# --- judge (pointwise) -------------------------------------------------------------------------------------


async def test_judge_sees_rubric_answer_and_reference_and_scores_0_to_1(context: HookContext) -> None:
    rubric = "Full marks only when the product is exactly right and explained."
    judge = ScriptedJudge(in_order(['{"score": 7, "reason": "right, terse"}']))
    subject = answered("s1", "It is 42 because 6*7=42.", reference="42")
    result = await judged(judge, "judge", subject, context, rubric=rubric, temperature=0.3, max_tokens=77)

    assert len(judge.calls) == 1
    call = judge.calls[0]
    assert rubric in call.prompt
    assert "It is 42 because 6*7=42." in call.prompt
    assert "<reference_answer>\n42\n</reference_answer>" in call.prompt
    assert TASK in call.prompt and "Be brief." in call.prompt  # the conversation that led to the answer
    assert call.body["model"] == "judge-model"
    assert call.body["temperature"] == 0.3 and call.body["max_tokens"] == 77
    assert call.headers["Authorization"] == "Bearer sk-test"
    assert isinstance(result, contract.HookResult)
    assert result.session == pytest.approx(0.7)
    assert result.details["scores"] == [pytest.approx(0.7)]
    assert result.details["reasons"] == ["right, terse"]


async def test_judge_without_reference_shows_none(context: HookContext) -> None:
    judge = ScriptedJudge(in_order(['{"score": 3}']))
    await judged(judge, "judge", answered("s1", "43"), context, rubric="Be right.")
    assert "reference_answer" not in judge.calls[0].prompt


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('{"score": 4, "reason": "ok"}', 0.75),  # (4 - 1) / (5 - 1)
        ('Here you go:\n```json\n{"score": 12, "reason": "great"}\n```', 1.0),  # clamped to scale_max
        ('{"score": -3}', 0.0),  # clamped to scale_min
        ("I think it is decent.\nScore: 2", 0.25),  # the `Score: n` line fallback
        ('{"score": "3"}', 0.5),  # a numeric string
    ],
)
async def test_judge_clamps_and_normalises_to_the_scale(
    context: HookContext, answer: str, expected: float
) -> None:
    judge = ScriptedJudge(in_order([answer]))
    result = await judged(judge, "judge", answered("s1", "42"), context, rubric="r", scale_min=1, scale_max=5)
    assert "from 1 to 5" in judge.calls[0].prompt
    assert result.session == pytest.approx(expected)


async def test_judge_samples_three_calls_and_takes_the_mean(context: HookContext) -> None:
    answers = ['{"score": 2}', '{"score": 4}', '{"score": 9}']
    judge = ScriptedJudge(in_order(answers))
    result = await judged(judge, "judge", answered("s1", "42"), context, rubric="r", samples=3)
    assert len(judge.calls) == 3
    assert result.session == pytest.approx(0.5)
    assert sorted(result.details["scores"]) == pytest.approx([0.2, 0.4, 0.9])


@pytest.mark.parametrize("answer", ["I cannot grade this.", '{"reason": "no score"}', '{"score": NaN}', ""])
async def test_judge_unparseable_answer_raises(context: HookContext, answer: str) -> None:
    judge = ScriptedJudge(in_order([answer]))
    with pytest.raises(JudgeAnswerError):
        await judged(judge, "judge", answered("s1", "42"), context, rubric="r")


async def test_judge_http_error_raises_without_retrying(context: HookContext) -> None:
    judge = ScriptedJudge(in_order([Failure(500)]))
    with pytest.raises(openai.InternalServerError):
        await judged(judge, "judge", answered("s1", "42"), context, rubric="r")
    assert len(judge.calls) == 1  # the job system retries the whole job, not the client


@pytest.mark.parametrize(("limit", "overlap"), [(1, False), (3, True)])
async def test_max_concurrent_calls_bounds_requests_in_flight(
    context: HookContext, limit: int, overlap: bool
) -> None:
    # Each request waits (briefly) for a second one to be in flight: it comes only when the limit allows.
    judge = ScriptedJudge(in_order(['{"score": 5}']), hold_until=2, hold_timeout_s=0.3)
    subject = answered("s1", "42")
    result = await judged(judge, "judge", subject, context, rubric="r", samples=3, max_concurrent_calls=limit)
    assert len(judge.calls) == 3 and result.session == pytest.approx(0.5)
    if overlap:
        assert judge.max_in_flight >= 2
    else:
        assert judge.max_in_flight == 1


# --- arguments and build -----------------------------------------------------------------------------------


def test_api_key_env_missing_is_an_error_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYWHEEL_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(JudgeConfigError, match="FLYWHEEL_TEST_JUDGE_KEY"):
        build("judge", base_url="http://127.0.0.1:1/v1", api_key=None, api_key_env="FLYWHEEL_TEST_JUDGE_KEY",
              rubric="r")


async def test_api_key_env_is_read_at_build_and_sent(
    monkeypatch: pytest.MonkeyPatch, context: HookContext
) -> None:
    monkeypatch.setenv("FLYWHEEL_TEST_JUDGE_KEY", "sk-from-env")
    async with ScriptedJudge(in_order(['{"score": 5}'])) as judge:
        key = {"api_key": None, "api_key_env": "FLYWHEEL_TEST_JUDGE_KEY"}
        hook = build("judge", base_url=judge.base_url, rubric="r", **key)
        monkeypatch.delenv("FLYWHEEL_TEST_JUDGE_KEY")  # already resolved
        await hook(answered("s1", "42"), context)
        await hook.aclose()
    assert judge.calls[0].headers["Authorization"] == "Bearer sk-from-env"


@pytest.mark.parametrize(
    "bad",
    [
        {},  # neither key
        {"api_key": "k", "api_key_env": "K"},  # both keys
        {"api_key": "k", "temprature": 0.5},  # an unknown field
        {"api_key": "k", "scale_min": 5, "scale_max": 5},  # an empty scale
        {"api_key": "k", "samples": 0},
        {"api_key": "k", "max_concurrent_calls": 0},
    ],
)
def test_judge_args_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        FACTORY["judge"].args(base_url="http://x/v1", model="m", rubric="r", **bad)


def test_factories_name_the_three_hooks() -> None:
    levels = {("judge", "session"), ("group_ranking", "group"), ("next_state", "session")}
    assert {(f.name, f.level) for f in FACTORIES} == levels
    for factory in FACTORIES:
        assert factory.args.model_config.get("extra") == "forbid"
        extra = {"rubric": "r"} if factory.name == "judge" else {}
        args = factory.args(base_url="http://x/v1", model="m", api_key="k", **extra)
        assert factory.build(args).level == factory.level


# --- group_ranking -----------------------------------------------------------------------------------------

MEMBER = re.compile(r"<answer id=([A-Z]+)>\n(.*?)\n</answer", re.S)


def rank_by_answer(scores_by_answer: dict[str, float]) -> Callable[[JudgeCall], str]:
    """A judge that reads which label holds which answer from the prompt and scores it by its answer."""

    def reply(call: JudgeCall) -> str:
        labelled = dict(MEMBER.findall(call.prompt))
        scores = {label: scores_by_answer[text] for label, text in labelled.items()}
        return f'Ranking done. {{"scores": {scores!r}, "reason": "by correctness"}}'.replace("'", '"')

    return reply


def group(*answers: str) -> GroupInput:
    """A group of one-turn sessions s0, s1, … answering TASK."""
    sessions = tuple(answered(f"s{i}", answer) for i, answer in enumerate(answers))
    return GroupInput(group_id="g", task=TASK, sessions=sessions)


async def test_group_ranking_makes_one_call_and_maps_scores_back_to_sessions(context: HookContext) -> None:
    answers = {"42": 1.0, "41": 0.3, "I don't know": 0.0, "6*7 = 42": 0.9}
    judge = ScriptedJudge(rank_by_answer(answers))
    result = await judged(judge, "group_ranking", group(*answers), context)

    assert len(judge.calls) == 1
    prompt = judge.calls[0].prompt
    assert prompt.count(TASK) == 1  # the shared task once
    assert dict(MEMBER.findall(prompt)) == {"A": "42", "B": "41", "C": "I don't know", "D": "6*7 = 42"}
    assert isinstance(result, contract.GroupResult)
    scores = {sid: r.session for sid, r in result.sessions.items()}
    assert scores == {"s0": 1.0, "s1": 0.3, "s2": 0.0, "s3": 0.9}
    assert result.sessions["s2"].details == {"label": "C", "reason": "by correctness"}


@pytest.mark.parametrize(
    "answer",
    [
        '{"scores": {"A": 1, "B": 0.5, "C": 0.2}}',  # D missing
        '{"scores": {"A": 1, "B": 0.5, "C": 0.2, "D": 0.1, "E": 0.9}}',  # E is no member
        '{"scores": {"A": 1, "B": 0.5, "C": 0.2, "D": "high"}}',  # not a number
        '{"scores": [1, 0.5, 0.2, 0.1]}',  # not by id
        "A is best, then D.",
    ],
)
async def test_group_ranking_rejects_missing_or_extra_ids(context: HookContext, answer: str) -> None:
    judge = ScriptedJudge(in_order([answer]))
    with pytest.raises(JudgeAnswerError):
        await judged(judge, "group_ranking", group("a", "b", "c", "d"), context)


async def test_group_ranking_truncates_the_middle_of_long_answers(context: HookContext) -> None:
    long_answer = "START" + "x" * 5000 + "END"
    reply = in_order(['{"scores": {"A": 0.2, "B": 0.8}, "reason": "B is shorter"}'])
    judge = ScriptedJudge(reply)
    result = await judged(judge, "group_ranking", group(long_answer, "42"), context, max_chars_per_member=100)
    prompt = judge.calls[0].prompt
    assert "START" in prompt and "END" in prompt and "x" * 101 not in prompt
    assert "characters left out" in prompt
    assert result.sessions["s0"].session == pytest.approx(0.2)


# --- next_state --------------------------------------------------------------------------------------------

WHAT_FOLLOWED = re.compile(r"<what_followed>\n(.*?)\n</what_followed>", re.S)
TURN = re.compile(r"<assistant_turn>\n(.*?)\n</assistant_turn>", re.S)


def verdicts_by_reply(script: dict[str, list[str]]) -> Callable[[JudgeCall], str]:
    """A judge whose verdicts, in turn, depend on which reply followed the judged turn."""
    counters = dict.fromkeys(script, 0)

    def reply(call: JudgeCall) -> str:
        followed = WHAT_FOLLOWED.search(call.prompt)
        assert followed is not None
        key = next(k for k in script if k in followed.group(1))
        verdict = script[key][counters[key]]
        counters[key] += 1
        return f'{{"verdict": "{verdict}", "reason": "scripted"}}'

    return reply


def three_turns() -> SessionInput:
    """q1 → a1, "r1: wrong, try again" → a2, "r2: thanks" → a3 (the last turn: nothing follows it)."""
    m0 = [{"role": "system", "content": "Help."}, user("q1: what is 6*7?")]
    m1 = [*m0, assistant("a1: 41"), user("r1: wrong, try again")]
    m2 = [*m1, assistant("a2: 42"), user("r2: thanks, correct")]
    return session(
        "s1",
        [
            completion("c0", m0, "a1: 41"),
            completion("c1", m1, "a2: 42", parent_id="c0"),
            completion("c2", m2, "a3: you're welcome", parent_id="c1"),
        ],
    )


async def test_next_state_majority_of_three_votes_per_turn(context: HookContext) -> None:
    script = {"r1: wrong": ["good", "bad", "good"], "r2: thanks": ["bad", "bad", "good"]}
    judge = ScriptedJudge(verdicts_by_reply(script))
    result = await judged(judge, "next_state", three_turns(), context)

    assert isinstance(result, contract.HookResult)
    assert dict(result.completions) == {"c0": 1.0, "c1": -1.0}  # c2, the last turn, gets nothing
    assert result.session is None
    assert len(judge.calls) == 6
    seen = sorted((TURN.findall(c.prompt)[0], WHAT_FOLLOWED.findall(c.prompt)[0]) for c in judge.calls)
    first, second = ("a1: 41", "[user]\nr1: wrong, try again"), ("a2: 42", "[user]\nr2: thanks, correct")
    assert seen == [first] * 3 + [second] * 3  # each turn with the real reply that followed it
    assert sorted(result.details["votes"]["c1"]) == ["bad", "bad", "good"]


async def test_next_state_rewards_are_configurable_and_ties_are_neutral(context: HookContext) -> None:
    script = {"r1: wrong": ["neutral", "good"], "r2: thanks": ["good", "good"]}
    judge = ScriptedJudge(verdicts_by_reply(script))
    rewards = {"votes": 2, "good_reward": 0.5, "neutral_reward": 0.1}
    result = await judged(judge, "next_state", three_turns(), context, **rewards)
    assert dict(result.completions) == {"c0": 0.1, "c1": 0.5}


async def test_next_state_judges_tool_results_and_skips_untrainable_turns(context: HookContext) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": "6*7"}'}}
    m0 = [user("q1: compute 6*7")]
    m1 = [*m0, {"role": "assistant", "content": None, "tool_calls": [call]}]
    m1.append({"role": "tool", "tool_call_id": "call_1", "content": "r1: 42"})
    m2 = [*m1, assistant("a2: it is 42"), user("r2: ok")]
    c0 = completion("c0", m0, "", tool_calls=[call])
    c1 = completion("c1", m1, "a2: it is 42", trainable=False)
    subject = session("s1", [c0, c1, completion("c2", m2, "a3: bye")])
    judge = ScriptedJudge(verdicts_by_reply({"r1: 42": ["good"] * 3}))
    result = await judged(judge, "next_state", subject, context)
    assert dict(result.completions) == {"c0": 1.0}  # c1 untrainable, c2 last
    assert len(judge.calls) == 3
    assert '[tool call] calc({"x": "6*7"})' in TURN.findall(judge.calls[0].prompt)[0]
    assert WHAT_FOLLOWED.findall(judge.calls[0].prompt)[0] == "[tool call_1]\nr1: 42"


async def test_next_state_follows_the_completion_that_continues_the_turn(context: HookContext) -> None:
    # Two conversations interleaved in one session: c0's next state is in c1, not in x0 right after it.
    m0 = [user("q1")]
    other = completion("x0", [user("other question")], "other answer")
    c1 = completion("c1", [*m0, assistant("a1"), user("r1: nice")], "a2")
    subject = session("s1", [completion("c0", m0, "a1"), other, c1])
    judge = ScriptedJudge(verdicts_by_reply({"r1: nice": ["good"] * 3}))
    result = await judged(judge, "next_state", subject, context)
    assert dict(result.completions) == {"c0": 1.0}


async def test_next_state_trusts_parent_ids_over_message_text(context: HookContext) -> None:
    # b1 repeats c0's messages but extends another completion (its parent says so): not c0's next state.
    # c1 extends c0 by its parent although the agent dropped its system prompt since.
    m0 = [{"role": "system", "content": "time: 10:00"}, user("q1")]
    b1 = completion("b1", [*m0, assistant("a1"), user("r0: from elsewhere")], "b", parent_id="other")
    m1 = [user("q1"), assistant("a1"), user("r1: yes")]
    c1 = completion("c1", m1, "a2", parent_id="c0")
    subject = session("s1", [completion("c0", m0, "a1"), b1, c1])
    judge = ScriptedJudge(verdicts_by_reply({"r1: yes": ["bad"] * 3}))
    result = await judged(judge, "next_state", subject, context)
    assert dict(result.completions) == {"c0": -1.0}
    assert all("r0: from elsewhere" not in call.prompt for call in judge.calls)


async def test_next_state_bad_verdict_raises(context: HookContext) -> None:
    judge = ScriptedJudge(in_order(['{"verdict": "excellent"}']))
    with pytest.raises(JudgeAnswerError):
        await judged(judge, "next_state", three_turns(), context)


@pytest.mark.parametrize(
    ("name", "subject", "args"),
    [
        ("judge", session("s1", []), {"rubric": "r"}),  # no completion, no answer
        ("group_ranking", group("42"), {}),  # a group of one: nothing to rank it against
        ("next_state", answered("s1", "42"), {}),  # one turn: nothing followed it
    ],
)
async def test_no_opinion_without_anything_to_judge(
    context: HookContext, name: str, subject: Any, args: dict[str, Any]
) -> None:
    judge = ScriptedJudge(in_order(['{"score": 5}']))
    assert await judged(judge, name, subject, context, **args) is None
    assert judge.calls == []


# --- prompts and parsers -----------------------------------------------------------------------------------


def test_parsers_read_the_first_json_object_or_a_line() -> None:
    assert prompts.first_json_object('x {"a": {"score": 1}} {"score": 2}', key="score") == {"score": 1}
    assert prompts.first_json_object("no object {here", key="score") is None
    assert prompts.parse_score('{"score": 6.5, "reason": "fine"}') == (6.5, "fine")
    assert prompts.parse_score("**Score:** 8/10") == (8.0, "")
    assert prompts.parse_verdict("Verdict: BAD, the user complained") == "bad"
    assert prompts.parse_verdict('```json\n{"verdict": " Good "}\n```') == "good"
    with pytest.raises(JudgeAnswerError):
        prompts.parse_score('{"score": true}')


def test_majority_ties_are_neutral() -> None:
    assert prompts.majority(["good", "bad", "good"]) == "good"
    assert prompts.majority(["bad", "bad", "good"]) == "bad"
    assert prompts.majority(["good", "bad", "neutral"]) == "neutral"
    assert prompts.majority(["good", "bad"]) == "neutral"
    assert prompts.majority([]) == "neutral"


def test_truncate_middle_and_labels() -> None:
    assert prompts.truncate_middle("abcdef", 6) == "abcdef"
    cut = prompts.truncate_middle("a" * 50 + "b" * 50, 10)
    assert cut.startswith("aaaaa\n") and cut.endswith("\nbbbbb") and "90 characters left out" in cut
    labels = [prompts.member_label(i) for i in (0, 1, 25, 26, 27, 701, 702)]
    assert labels == ["A", "B", "Z", "AA", "AB", "ZZ", "AAA"]
