"""The `feedback` hook (session): a session's user feedback (`POST /rl/v1/feedback`) as one session reward,
the mean over the completions it is on of what each one's feedback counts as. As with rewards, per
completion the latest feedback counts: its latest value (or thumbs); without one, and with `judge` set,
its latest comment, as an LLM judge reads how satisfied the user was, mapped onto
`comment_min..comment_max`. Without `judge`, comments are left out. A session without any feedback that
counts: no opinion.

The hook sees the feedback given by the time it runs (once the session has ended); feedback arriving
later reaches training through its own reward on the completion (docs/online.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rewards.hooks.contract import (
    CompletionView,
    FeedbackView,
    GroupInput,
    HookContext,
    HookFactory,
    HookLevel,
    HookResult,
    SessionInput,
)
from rewards.hooks.judge import JudgeArgs, JudgeClient, gather_all
from rewards.hooks.judge_prompts import (
    NO_TEXT,
    ChatMessage,
    message_text,
    normalise_score,
    parse_score,
    render_messages,
    render_task,
    truncate_middle,
)

JUDGE_SCALE = (0.0, 10.0)
"""The scale the judge scores a comment on, before it is mapped onto `comment_min..comment_max`."""


class FeedbackArgs(BaseModel):
    """The `feedback` hook's arguments."""

    model_config = ConfigDict(extra="forbid")

    judge: JudgeArgs | None = None
    """The judge that reads comments given without a value (`base_url`, `model`, a key: as the `judge`
    hook's); None: such comments are left out."""
    comment_min: float = -1.0
    """What the most dissatisfied comment counts as."""
    comment_max: float = 1.0
    """What the most satisfied comment counts as."""
    max_chars_conversation: int = Field(default=8000, ge=1)
    """How much of the conversation before the judged answer the judge sees (its middle is cut)."""

    @model_validator(mode="after")
    def _range(self) -> Self:
        if not self.comment_max > self.comment_min:
            raise ValueError("comment_max must be greater than comment_min")
        return self


def counted(feedback: Sequence[FeedbackView]) -> list[FeedbackView]:
    """Per completion (in order of its first feedback), the feedback that counts: the latest with a
    value, else the latest comment."""
    chosen: dict[str, FeedbackView] = {}
    for item in feedback:
        current = chosen.get(item.completion_id)
        if item.value is not None or (item.comment and (current is None or current.value is None)):
            chosen[item.completion_id] = item
    return list(chosen.values())


def comment_messages(task: Any, conversation: str, answer: str, comment: str) -> list[ChatMessage]:
    """The messages asking a judge how satisfied a user's comment says they were with an answer."""
    low, high = JUDGE_SCALE
    system = (
        "You are an impartial judge. A user gave written feedback on an AI assistant's answer; you read how "
        f"satisfied the feedback says the user was, from {low:g} (not at all) to {high:g} (completely).\n"
        'Reply with exactly one JSON object and nothing else: {"score": <a number from '
        f'{low:g} to {high:g}>, "reason": "<one sentence>"}}.'
    )
    sections = [
        f"<task>\n{render_task(task)}\n</task>",
        f"<conversation>\n{conversation}\n</conversation>",
        f"<answer>\n{answer or NO_TEXT}\n</answer>",
        f"<user_feedback>\n{comment}\n</user_feedback>",
        f"How satisfied is the user with the answer, from {low:g} to {high:g}?",
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]


class FeedbackHook:
    """A session's feedback as one session reward (see the module docstring)."""

    level: HookLevel = "session"

    def __init__(self, args: FeedbackArgs) -> None:
        self.args = args
        self.judge = None if args.judge is None else JudgeClient(args.judge)

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        """The mean of `subject`'s feedback values and judged comments."""
        if not isinstance(subject, SessionInput):
            raise TypeError("the feedback hook labels sessions")
        chosen = counted(subject.feedback)
        values = [item.value for item in chosen if item.value is not None]
        comments = [item for item in chosen if item.value is None] if self.judge is not None else []
        completions = {completion.id: completion for completion in subject.completions}
        judged = await gather_all(
            self._judge(subject.task, completions.get(f.completion_id), f) for f in comments
        )
        scores = [score for score, _ in judged]
        if not values and not scores:
            return None
        everything = values + scores
        return HookResult(
            session=sum(everything) / len(everything),
            details={"values": values, "judged": scores, "reasons": [reason for _, reason in judged]},
        )

    async def _judge(
        self, task: Any, completion: CompletionView | None, feedback: FeedbackView
    ) -> tuple[float, str]:
        assert self.judge is not None and feedback.comment is not None
        args = self.args
        conversation = "" if completion is None else render_messages(completion.messages)
        answer = "" if completion is None else message_text(completion.message)
        messages = comment_messages(
            task, truncate_middle(conversation, args.max_chars_conversation), answer, feedback.comment
        )
        score, reason = parse_score(await self.judge.ask(messages))
        unit = normalise_score(score, *JUDGE_SCALE)
        return args.comment_min + unit * (args.comment_max - args.comment_min), reason

    async def aclose(self) -> None:
        """Close the judge client's connections."""
        if self.judge is not None:
            await self.judge.aclose()


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="feedback",
        level="session",
        args=FeedbackArgs,
        build=FeedbackHook,
        summary="users' feedback (values, thumbs; comments read by an optional LLM judge), their mean",
    ),
)
