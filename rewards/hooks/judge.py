"""The LLM judge hooks: graders that ask a model behind any OpenAI-compatible endpoint (our own proxy
included) to label a finished session.

- `judge` (session): a pointwise score against a rubric, the mean of `samples` judgements, mapped to 0..1.
- `group_ranking` (group): one judgement that sees every member of a group and scores each relative to
  the others (RULER-style), 0..1 per session.
- `next_state` (session): each assistant turn judged by the message that followed it (the user's reply
  or the tool results), majority of `votes` judgements → a reward per completion.

Each hook instance owns one `openai.AsyncOpenAI` client, built on its first call, with no retries (the job
system retries the whole job) and a semaphore bounding its calls in flight (`max_concurrent_calls`):
judge calls cost money. The prompts and parsers are in judge_prompts.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, Self, TypeVar, cast

import openai
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from rewards.hooks.contract import (
    CompletionView,
    GroupInput,
    GroupResult,
    HookContext,
    HookFactory,
    HookLevel,
    HookResult,
    SessionInput,
)
from rewards.hooks.judge_prompts import (
    ChatMessage,
    JudgeAnswerError,
    Verdict,
    content_text,
    majority,
    member_label,
    message_text,
    next_state_messages,
    normalise_score,
    parse_ranking,
    parse_score,
    parse_verdict,
    pointwise_messages,
    ranking_messages,
    render_message,
    render_messages,
    truncate_middle,
)

T = TypeVar("T")


class JudgeConfigError(ValueError):
    """A judge hook cannot be built as configured (its API key's environment variable is not set)."""


class JudgeArgs(BaseModel):
    """What every judge hook is given: the endpoint, the model and how to call it."""

    model_config = ConfigDict(extra="forbid")

    base_url: str
    """An OpenAI-compatible base URL, e.g. `https://api.openai.com/v1` or our own proxy's `…/v1`."""
    api_key: SecretStr | None = None
    """The key itself (a string; kept out of reprs and logs)."""
    api_key_env: str | None = None
    """The name of an environment variable holding the key, read when the hook is built. Give exactly one
    of `api_key` and `api_key_env`."""
    model: str
    temperature: float = Field(default=0.0, ge=0.0)
    max_tokens: int = Field(default=512, ge=1)
    timeout_s: float = Field(default=60.0, gt=0.0)
    """The limit of one judge call."""
    max_concurrent_calls: int = Field(default=4, ge=1)
    """How many of this hook's judge calls may be in flight at once."""

    @model_validator(mode="after")
    def _one_key(self) -> Self:
        if (self.api_key is None) == (self.api_key_env is None):
            raise ValueError("give exactly one of api_key and api_key_env")
        return self


class PointwiseJudgeArgs(JudgeArgs):
    """The `judge` hook: a score on `scale_min..scale_max` following `rubric`, the mean of `samples`."""

    rubric: str = Field(min_length=1)
    scale_min: float = 0.0
    scale_max: float = 10.0
    samples: int = Field(default=1, ge=1)
    max_chars_conversation: int = Field(default=16000, ge=1)
    """How much of the conversation before the answer the judge sees (its middle is cut)."""

    @model_validator(mode="after")
    def _scale(self) -> Self:
        if not self.scale_max > self.scale_min:
            raise ValueError("scale_max must be greater than scale_min")
        return self


class GroupRankingArgs(JudgeArgs):
    """The `group_ranking` hook: one judgement scoring every member of a group relative to the others."""

    rubric: str | None = None
    """Extra criteria for the comparison (optional)."""
    max_chars_per_member: int = Field(default=4000, ge=1)
    """How much of each member's final answer the judge sees (its middle is cut)."""


class NextStateArgs(JudgeArgs):
    """The `next_state` hook: each turn judged `votes` times by what followed it; the majority's reward."""

    votes: int = Field(default=3, ge=1)
    good_reward: float = 1.0
    bad_reward: float = -1.0
    neutral_reward: float = 0.0
    max_chars_per_message: int = Field(default=4000, ge=1)
    """How much of the answered message, the turn and what followed it the judge sees (each cut in the
    middle)."""


def resolve_api_key(args: JudgeArgs) -> str:
    """The key to send: `api_key`, or the value of the environment variable `api_key_env` (an error naming
    it when it is not set)."""
    if args.api_key is not None:
        return args.api_key.get_secret_value()
    name = cast(str, args.api_key_env)
    value = os.environ.get(name)
    if not value:
        raise JudgeConfigError(f"judge hook: the environment variable {name} (api_key_env) is not set")
    return value


class JudgeClient:
    """One hook's way to its judge: the client (built on first use), the model's settings, and the
    semaphore bounding calls in flight."""

    def __init__(self, args: JudgeArgs) -> None:
        self.args = args
        self.api_key = resolve_api_key(args)
        self._client: openai.AsyncOpenAI | None = None
        self._slots = asyncio.Semaphore(args.max_concurrent_calls)

    def client(self) -> openai.AsyncOpenAI:
        """The OpenAI client, built on the first call."""
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                base_url=self.args.base_url,
                api_key=self.api_key,
                max_retries=0,
                timeout=self.args.timeout_s,
            )
        return self._client

    async def ask(self, messages: list[ChatMessage]) -> str:
        """The judge's answer text to `messages` (waits for a free slot first)."""
        async with self._slots:
            response = await self.client().chat.completions.create(
                model=self.args.model,
                messages=cast(list[ChatCompletionMessageParam], messages),
                temperature=self.args.temperature,
                max_tokens=self.args.max_tokens,
            )
        if not response.choices:
            raise JudgeAnswerError("the judge's response has no choices")
        return response.choices[0].message.content or ""

    async def aclose(self) -> None:
        """Close the client's connections (a later call builds a new client)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """All results in order; on the first failure (or on cancellation) the others are cancelled and the
    failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


# --- judge: pointwise --------------------------------------------------------------------------------------


class JudgeHook:
    """Scores a session's final answer against a rubric: `samples` judgements, each clamped to the scale
    and mapped to 0..1, their mean the session reward. A session without completions: no opinion."""

    level: HookLevel = "session"

    def __init__(self, args: PointwiseJudgeArgs) -> None:
        self.args = args
        self.judge = JudgeClient(args)

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        """Judge `subject`'s final answer."""
        if not isinstance(subject, SessionInput):
            raise TypeError("the judge hook labels sessions")
        final = subject.final
        if final is None:
            return None
        args = self.args
        messages = pointwise_messages(
            task=subject.task,
            conversation=truncate_middle(render_messages(final.messages), args.max_chars_conversation),
            answer=message_text(final.message),
            reference=subject.expected("answer"),
            rubric=args.rubric,
            scale_min=args.scale_min,
            scale_max=args.scale_max,
        )
        answers = await gather_all(self.judge.ask(messages) for _ in range(args.samples))
        parsed = [parse_score(answer) for answer in answers]
        scores = [normalise_score(score, args.scale_min, args.scale_max) for score, _ in parsed]
        return HookResult(
            session=sum(scores) / len(scores),
            details={
                "scores": scores,
                "raw_scores": [score for score, _ in parsed],
                "reasons": [reason for _, reason in parsed],
            },
        )

    async def aclose(self) -> None:
        """Close the judge client's connections."""
        await self.judge.aclose()


# --- group_ranking: relative, RULER-style ------------------------------------------------------------------


def member_answers(sessions: Sequence[SessionInput], max_chars: int) -> dict[str, str]:
    """Each session's final answer (its middle cut past `max_chars`) by its label A, B, … in order."""
    answers = {}
    for index, session in enumerate(sessions):
        final = session.final
        text = "" if final is None else message_text(final.message)
        answers[member_label(index)] = truncate_middle(text, max_chars)
    return answers


class GroupRankingHook:
    """Scores every session of a group relative to the others in ONE judgement that sees all their final
    answers (labelled A, B, …) and the shared task once: 0..1 per session. A group of fewer than two
    sessions has nothing to be ranked against: no opinion."""

    level: HookLevel = "group"

    def __init__(self, args: GroupRankingArgs) -> None:
        self.args = args
        self.judge = JudgeClient(args)

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> GroupResult | None:
        """Rank `subject`'s sessions."""
        if not isinstance(subject, GroupInput):
            raise TypeError("the group_ranking hook labels groups")
        if len(subject.sessions) < 2:
            return None
        answers = member_answers(subject.sessions, self.args.max_chars_per_member)
        messages = ranking_messages(task=subject.task, answers=answers, rubric=self.args.rubric)
        scores, reason = parse_ranking(await self.judge.ask(messages), list(answers))
        labels = list(answers)
        return GroupResult(
            sessions={
                session.session_id: HookResult(
                    session=scores[label], details={"label": label, "reason": reason}
                )
                for label, session in zip(labels, subject.sessions, strict=True)
            }
        )

    async def aclose(self) -> None:
        """Close the judge client's connections."""
        await self.judge.aclose()


# --- next_state: each turn judged by what followed it ------------------------------------------------------


Following = tuple[dict[str, Any], ...]
"""The messages that followed a turn."""


def _same_text(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("role") == b.get("role") and content_text(a.get("content")) == content_text(b.get("content"))


def following(turn: CompletionView, later: CompletionView) -> Following:
    """What `later` added after `turn`'s answer when it continues `turn`, else ().

    `later` continues `turn` when its parent is `turn`, or (without a parent) when its prompt is `turn`'s
    prompt, then an assistant message (the answer), then more. What it added is everything after its last
    assistant message: a user reply, tool results."""
    if later.parent_id is not None and later.parent_id != turn.id:
        return ()
    roles = [message.get("role") for message in later.messages]
    if "assistant" not in roles:
        return ()
    answer_at = len(roles) - 1 - roles[::-1].index("assistant")
    if later.parent_id is None:
        size = len(turn.messages)
        prefix = later.messages[:size]
        if answer_at != size or not all(_same_text(a, b) for a, b in zip(turn.messages, prefix, strict=True)):
            return ()
    return tuple(later.messages[answer_at + 1 :])


def next_state(completions: Sequence[CompletionView], index: int) -> Following:
    """What followed turn `index`: what the first later completion that continues it added after the
    turn's answer; () when no later completion continues it (the conversation's last turn)."""
    turn = completions[index]
    for later in completions[index + 1 :]:
        if added := following(turn, later):
            return added
    return ()


def judged_turns(completions: Sequence[CompletionView]) -> list[tuple[CompletionView, Following]]:
    """The trainable turns that something followed, each with what followed it."""
    turns = []
    for index, turn in enumerate(completions):
        if turn.trainable and (following := next_state(completions, index)):
            turns.append((turn, following))
    return turns


class NextStateHook:
    """Rewards each assistant turn by the reaction it got (OpenClaw-RL's next-state judge): turn i is
    judged `votes` times on its answer and the messages that followed it in the next completion that
    continues it (the user's reply or the tool results); the majority verdict (a tie is neutral) gives
    the turn `good_reward`, `bad_reward` or `neutral_reward`. Only trainable turns are judged.

    The last turn of a conversation has nothing after it: this hook gives it no reward (it waits for an
    explicit reward, e.g. the session's own). A session with no turn to judge: no opinion."""

    level: HookLevel = "session"

    def __init__(self, args: NextStateArgs) -> None:
        self.args = args
        self.judge = JudgeClient(args)

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        """Judge every turn of `subject` that something followed."""
        if not isinstance(subject, SessionInput):
            raise TypeError("the next_state hook labels sessions")
        turns = judged_turns(subject.completions)
        if not turns:
            return None
        verdicts = await gather_all(self._votes(subject.task, turn, following) for turn, following in turns)
        votes_by_id = {turn.id: votes for (turn, _), votes in zip(turns, verdicts, strict=True)}
        return HookResult(
            completions={cid: self._reward(majority(votes)) for cid, votes in votes_by_id.items()},
            details={"votes": votes_by_id},
        )

    async def _votes(
        self, task: Any, turn: CompletionView, following: Sequence[Mapping[str, Any]]
    ) -> list[Verdict]:
        limit = self.args.max_chars_per_message
        answered = render_message(turn.messages[-1]) if turn.messages else ""
        messages = next_state_messages(
            task=task,
            context=truncate_middle(answered, limit),
            turn=truncate_middle(message_text(turn.message), limit),
            next_state=truncate_middle(render_messages(following), limit),
        )
        answers = await gather_all(self.judge.ask(messages) for _ in range(self.args.votes))
        return [parse_verdict(answer) for answer in answers]

    def _reward(self, verdict: Verdict) -> float:
        rewards: dict[Verdict, float] = {
            "good": self.args.good_reward,
            "bad": self.args.bad_reward,
            "neutral": self.args.neutral_reward,
        }
        return rewards[verdict]

    async def aclose(self) -> None:
        """Close the judge client's connections."""
        await self.judge.aclose()


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="judge",
        level="session",
        args=PointwiseJudgeArgs,
        build=JudgeHook,
        summary="an LLM judge scores the final answer against a rubric (mean of `samples`), 0..1",
    ),
    HookFactory(
        name="group_ranking",
        level="group",
        args=GroupRankingArgs,
        build=GroupRankingHook,
        summary="an LLM judge scores a group's answers relative to each other in one call, 0..1 each",
    ),
    HookFactory(
        name="next_state",
        level="session",
        args=NextStateArgs,
        build=NextStateHook,
        summary="an LLM judge rewards each turn by the user reply or tool result that followed it",
    ),
)
