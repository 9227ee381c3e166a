"""The built-in `math` hook: is the session's final answer the reference answer, mathematically?

The answer is extracted from the final completion's text (`extract_final_answer`: GSM8K's `#### n`, else
the last `\\boxed{…}`, else "The answer is X", else the last number) and compared with the reference the
agent attached (`metadata["answer"]` or `task["answer"]`) by math-verify, in the hook pool's worker
processes under a hard per-item timeout: a comparison that makes sympy hang raises `HookTimeoutError`,
which the job system retries and then marks failed.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rewards.hooks.contract import (
    GroupInput,
    HookContext,
    HookFactory,
    HookLevel,
    HookResult,
    SessionInput,
)
from rewards.hooks.math_worker import answers_match

# GSM8K's final line: `#### 72`. The rest of the line is the answer.
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_IS = re.compile(r"\bthe\s+(?:final\s+)?answer\s+is\s*:?[ \t]*([^\n]+)", re.IGNORECASE)
# A sentence ends at a period followed by a space or the end (not the point of "0.5").
_SENTENCE_END = re.compile(r"\.(?=\s|$)")
# A number, with GSM8K's thousands separators ("1,234") and a decimal part; a minus only as a sign.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


class MathArgs(BaseModel):
    """Arguments of the `math` hook."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    answer_key: str = "answer"
    """Where the reference answer is: `metadata[answer_key]`, else `task[answer_key]`."""
    format_bonus: float = Field(default=0.0, ge=0)
    """Added when the answer is stated as `#### n` or `\\boxed{…}`, right or wrong."""
    correct_reward: float = 1.0
    """The reward of a correct answer."""
    timeout_s: float = Field(default=5.0, gt=0)
    """The limit of one comparison, enforced by the pool by killing its worker."""


def balanced_group(text: str, start: int) -> str | None:
    """The text from `start` up to the `}` that closes the brace just before `start` (nested groups
    included; LaTeX's escaped `\\{`, `\\}` do not count); None when it is never closed."""
    depth = 1
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
        index += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty `\\boxed{…}` in `text`, else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        content = balanced_group(text, match.end())
        if content is not None and content.strip():
            return content.strip()
    return None


def first_hashes_answer(text: str) -> str | None:
    """The rest of the first `####` line that has something after the marks, else None."""
    for match in _HASHES.finditer(text):
        answer = match.group(1).strip()
        if answer:
            return answer
    return None


def stated_answer(text: str) -> str | None:
    """X of the last "The (final) answer is X" (its first sentence, without markdown bold), else None."""
    matches = list(_ANSWER_IS.finditer(text))
    if not matches:
        return None
    answer = _SENTENCE_END.split(matches[-1].group(1), maxsplit=1)[0]
    answer = answer.replace("**", "").strip()
    return answer or None


def last_number(text: str) -> str | None:
    """The last number in `text` ("1,234", "-3", "0.5"), else None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_final_answer(text: str) -> tuple[str | None, bool]:
    """The final answer stated in `text`, and whether it was stated in a format (`#### n` or
    `\\boxed{…}`): the first `####` line, else the last `\\boxed{…}`, else "The (final) answer is X",
    else the last number; (None, False) when there is none."""
    for formatted_answer in (first_hashes_answer(text), last_boxed(text)):
        if formatted_answer is not None:
            return formatted_answer, True
    return stated_answer(text) or last_number(text), False


def gold_text(gold: Any) -> str | None:
    """The reference answer as text (a number becomes its digits); None when it is missing or blank."""
    if gold is None:
        return None
    text = str(gold).strip()
    return text or None


def math_reward(correct: bool, formatted: bool, args: MathArgs) -> float:
    """The session's reward: `correct_reward` when correct, plus `format_bonus` when formatted."""
    return args.correct_reward * correct + args.format_bonus * formatted


class MathHook:
    """Labels a session 1 (`correct_reward`) when its final answer equals the reference, else 0; plus
    `format_bonus` for a formatted answer. No opinion (None) on a session without a reference."""

    level: HookLevel = "session"

    def __init__(self, args: MathArgs) -> None:
        self.args = args

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        """Grade `subject`'s final answer; a comparison past `timeout_s` raises HookTimeoutError."""
        if not isinstance(subject, SessionInput):
            raise TypeError("the math hook labels sessions, not groups")
        gold = gold_text(subject.expected(self.args.answer_key))
        if gold is None:
            return None
        predicted, formatted = extract_final_answer(subject.answer_text)
        correct = predicted is not None and bool(
            await context.pool.run(answers_match, gold, predicted, timeout_s=self.args.timeout_s)
        )
        return HookResult(
            session=math_reward(correct, formatted, self.args),
            details={"predicted": predicted, "gold": gold, "correct": correct, "formatted": formatted},
        )


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="math",
        level="session",
        args=MathArgs,
        build=MathHook,
        summary="Final answer (#### n, \\boxed{}, 'The answer is') equals the reference, by math-verify.",
    ),
)
