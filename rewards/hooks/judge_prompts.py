"""The LLM judges' prompts and answer parsers (rewards/hooks/judge.py): pure functions that render the chat
messages a judge is sent and read its answer back, so the wording can be read and tested in one place.

Every judge answers one JSON object; the parsers take the first JSON object in the answer (a judge may wrap
it in prose or a code fence) and fall back to a `Score: n` / `Verdict: good` line. An answer they cannot
read raises `JudgeAnswerError`: the job that asked is retried.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ChatMessage = dict[str, str]
"""A rendered judge message: `{"role": "system" | "user", "content": …}`."""

Verdict = Literal["good", "bad", "neutral"]
VERDICTS: tuple[Verdict, ...] = ("good", "bad", "neutral")

NO_TEXT = "(nothing)"
ELLIPSIS = "\n[… {count} characters left out …]\n"

_SCORE_LINE = re.compile(r"^[\s*#_>-]*score[\s*_]*[:=][\s*_]*(-?\d+(?:\.\d+)?)", re.IGNORECASE | re.MULTILINE)
_VERDICT_LINE = re.compile(r"^[\s*#_>-]*verdict[\s*_]*[:=][\s*_\"']*(good|bad|neutral)\b", re.I | re.M)


class JudgeAnswerError(ValueError):
    """The judge's answer could not be read (no score, a verdict outside the choices, missing or extra
    members): the job is retried."""


# --- rendering --------------------------------------------------------------------------------------------


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` when it fits in `max_chars`, else its start and end with a marker saying how much is left
    out (the result stays within `max_chars` plus the marker)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = (max_chars + 1) // 2
    tail = max_chars - head
    kept_tail = text[len(text) - tail :] if tail else ""
    return text[:head] + ELLIPSIS.format(count=len(text) - max_chars) + kept_tail


def content_text(content: Any) -> str:
    """A message's `content` as text: a string as is, the text parts of a list of parts (other parts
    shown by their type), "" for None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                parts.append(text if isinstance(text, str) else f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return str(content)


def tool_calls_text(message: Mapping[str, Any]) -> str:
    """The tool calls of an assistant message, one `name(arguments)` a line ("" without any)."""
    lines = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            lines.append(f"{function.get('name', '?')}({function.get('arguments', '')})")
    return "\n".join(lines)


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text followed by its tool calls, each marked."""
    text = content_text(message.get("content"))
    calls = tool_calls_text(message)
    if calls:
        marked = "\n".join(f"[tool call] {line}" for line in calls.splitlines())
        text = f"{text}\n{marked}" if text else marked
    return text


def render_message(message: Mapping[str, Any]) -> str:
    """One message as a `[role]` header and its text."""
    role = str(message.get("role", "?"))
    if role == "tool" and message.get("tool_call_id"):
        role = f"tool {message['tool_call_id']}"
    return f"[{role}]\n{message_text(message) or NO_TEXT}"


def render_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages one after another, each with its role."""
    return "\n\n".join(render_message(m) for m in messages) or NO_TEXT


def render_task(task: Any) -> str:
    """The agent's task: a string as is, anything else as JSON; "(nothing)" for None."""
    if task is None:
        return NO_TEXT
    if isinstance(task, str):
        return task
    return json.dumps(task, ensure_ascii=False, default=str)


def member_label(index: int) -> str:
    """The short id of a group member: A … Z, then AA, AB, …"""
    label = ""
    index += 1
    while index > 0:
        index, rest = divmod(index - 1, 26)
        label = chr(ord("A") + rest) + label
    return label


def _section(tag: str, text: str) -> str:
    return f"<{tag}>\n{text}\n</{tag.split()[0]}>"


# --- pointwise judge ---------------------------------------------------------------------------------------


def pointwise_messages(
    *,
    task: Any,
    conversation: str,
    answer: str,
    reference: Any,
    rubric: str,
    scale_min: float,
    scale_max: float,
) -> list[ChatMessage]:
    """The messages of one pointwise judgement: the task, the reference answer (when there is one), the
    conversation that led to the answer, the answer and the rubric."""
    system = (
        "You are an impartial judge. You grade the final answer of an AI assistant against a rubric.\n"
        f"Reply with exactly one JSON object and nothing else: "
        f'{{"score": <a number from {_num(scale_min)} to {_num(scale_max)}>, "reason": "<one or two '
        f'sentences>"}}. Higher is better.'
    )
    sections = [_section("task", render_task(task))]
    if reference is not None:
        sections.append(_section("reference_answer", render_task(reference)))
    sections += [
        _section("conversation", conversation),
        _section("final_answer", answer or NO_TEXT),
        _section("rubric", rubric),
        f"Score the final answer from {_num(scale_min)} to {_num(scale_max)} following the rubric.",
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]


def parse_score(text: str) -> tuple[float, str]:
    """The score and reason of a pointwise answer: `{"score": n, "reason": …}` (the first JSON object with a
    score), else a `Score: n` line. Raises JudgeAnswerError when there is no finite score."""
    obj = first_json_object(text, key="score")
    if obj is not None:
        score = _number(obj["score"])
        if score is None:
            raise JudgeAnswerError(f"the judge's score is not a finite number: {obj['score']!r}")
        return score, str(obj.get("reason", ""))
    match = _SCORE_LINE.search(text)
    if match is None:
        raise JudgeAnswerError(f"no score in the judge's answer: {_excerpt(text)}")
    return float(match.group(1)), ""


def normalise_score(score: float, scale_min: float, scale_max: float) -> float:
    """`score` clamped to the scale and mapped to 0..1."""
    clamped = min(max(score, scale_min), scale_max)
    return (clamped - scale_min) / (scale_max - scale_min)


# --- group ranking -----------------------------------------------------------------------------------------


def ranking_messages(*, task: Any, answers: Mapping[str, str], rubric: str | None) -> list[ChatMessage]:
    """The messages of one relative ranking: the shared task once, then each member's final answer under
    its label."""
    labels = list(answers)
    shape = ", ".join(f'"{label}": <0..1>' for label in labels)
    system = (
        "You are an impartial judge. Several AI assistants attempted the same task; you compare their final "
        "answers with each other and score each from 0 (worst) to 1 (best), relative to the others: a "
        "better answer gets a higher score, equally good answers the same score.\n"
        f'Reply with exactly one JSON object and nothing else: {{"scores": {{{shape}}}, "reason": "<one or '
        f'two sentences>"}}, with a score for every one of {", ".join(labels)} and no other.'
    )
    sections = [_section("task", render_task(task))]
    sections += [_section(f"answer id={label}", answers[label] or NO_TEXT) for label in labels]
    if rubric:
        sections.append(_section("rubric", rubric))
    sections.append(f"Score every answer ({', '.join(labels)}) relative to the others.")
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]


def parse_ranking(text: str, labels: Sequence[str]) -> tuple[dict[str, float], str]:
    """The scores by label (clamped to 0..1) and the reason of a ranking answer. Raises JudgeAnswerError
    unless it scores exactly `labels`, each with a finite number."""
    obj = first_json_object(text, key="scores")
    if obj is None or not isinstance(obj["scores"], Mapping):
        raise JudgeAnswerError(f"no scores object in the judge's answer: {_excerpt(text)}")
    wanted = set(labels)
    scores: dict[str, float] = {}
    for key, value in obj["scores"].items():
        label = str(key).strip().upper()
        if label not in wanted:
            ids = ", ".join(labels)
            raise JudgeAnswerError(f"the judge scored an unknown id {key!r} (the ids are {ids})")
        if label in scores:
            raise JudgeAnswerError(f"the judge scored id {label!r} twice")
        number = _number(value)
        if number is None:
            raise JudgeAnswerError(f"the judge's score of {label!r} is not a finite number: {value!r}")
        scores[label] = min(max(number, 0.0), 1.0)
    missing = [label for label in labels if label not in scores]
    if missing:
        raise JudgeAnswerError(f"the judge did not score {', '.join(missing)}")
    return scores, str(obj.get("reason", ""))


# --- next-state judge --------------------------------------------------------------------------------------


def next_state_messages(*, task: Any, context: str, turn: str, next_state: str) -> list[ChatMessage]:
    """The messages of one next-state judgement: an assistant turn, the message it answered, and what
    came back after it (the user's reply or the tool results)."""
    system = (
        "You are an impartial judge of one turn of an AI assistant. You are shown the message it answered, "
        "its turn, and what came back after the turn: the user's reply or the results of the tools it "
        "called. Judge the turn by that reaction: it was good if the reaction shows it helped or worked "
        "(the user is satisfied or moves on, the tool succeeded), bad if the reaction shows it was wrong or "
        "failed (the user corrects, complains or repeats the request, the tool failed because of the "
        "assistant), neutral if the reaction says neither.\n"
        'Reply with exactly one JSON object and nothing else: {"verdict": "good" | "bad" | "neutral", '
        '"reason": "<one sentence>"}.'
    )
    sections = [
        _section("task", render_task(task)),
        _section("answered_message", context),
        _section("assistant_turn", turn),
        _section("what_followed", next_state),
        "Judge the assistant's turn by what followed it.",
    ]
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}]


def parse_verdict(text: str) -> Verdict:
    """The verdict of a next-state answer: `{"verdict": …}`, else a `Verdict: …` line. Raises
    JudgeAnswerError unless it is good, bad or neutral."""
    obj = first_json_object(text, key="verdict")
    if obj is not None:
        verdict = str(obj["verdict"]).strip().lower()
        for choice in VERDICTS:
            if verdict == choice:
                return choice
        raise JudgeAnswerError(f"the judge's verdict is not good, bad or neutral: {obj['verdict']!r}")
    match = _VERDICT_LINE.search(text)
    if match is None:
        raise JudgeAnswerError(f"no verdict in the judge's answer: {_excerpt(text)}")
    word = match.group(1).lower()
    return next(choice for choice in VERDICTS if choice == word)


def majority(votes: Sequence[Verdict]) -> Verdict:
    """The verdict with the most votes; a tie for the most (or no votes) is neutral."""
    counts = {choice: votes.count(choice) for choice in VERDICTS}
    top = max(counts.values())
    winners = [choice for choice, count in counts.items() if count == top]
    return winners[0] if len(winners) == 1 and top > 0 else "neutral"


# --- parsing helpers ---------------------------------------------------------------------------------------


def first_json_object(text: str, *, key: str | None = None) -> dict[str, Any] | None:
    """The first JSON object in `text` (with `key`, the first that has it), or None."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            value = None
        if isinstance(value, dict) and (key is None or key in value):
            return value
        start = text.find("{", start + 1)
    return None


def _number(value: Any) -> float | None:
    """A finite float from a JSON number or a numeric string; None otherwise (booleans included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _excerpt(text: str) -> str:
    return repr(truncate_middle(text, 200))
