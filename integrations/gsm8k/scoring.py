"""Scoring of GSM8K answers: pull the final number out of a model's text and turn it into a reward.

Pure functions, no I/O. The reward rule (see `reward`):

    reward = 1.0 · correct + format_bonus · formatted        (0 ≤ reward ≤ 1.0 + format_bonus)

where `correct` means the extracted final answer equals the gold answer as a number, and `formatted`
means the text states its answer as `#### <number>` (GSM8K's own form) somewhere. Several `####` lines
earn the bonus once; a formatted wrong answer earns only the bonus.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

DEFAULT_FORMAT_BONUS = 0.1

# A number as people and GSM8K write it: optional minus and dollar sign, thousands separators, a decimal
# part. Not preceded by a word character or a dot (so "x2" and the "5" of "3.5" are no numbers of their
# own) and not followed by a digit (so "1,2345" is not read as "1,234").
_NUMBER = r"(?<![\w.])(-)?\$?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?!\d)"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*" + _NUMBER)
_THE_ANSWER_RE = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?\s*" + _NUMBER, re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """The canonical form of a number: "1,234" → "1234", "$5.00" → "5", "2.50" → "2.5", "-3" → "-3";
    None when `text` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _number_of(match: re.Match[str]) -> str | None:
    sign, digits = match.group(1) or "", match.group(2)
    return normalize_number(sign + digits)


def extract_answer(text: str) -> str | None:
    """The final answer in `text`, normalized (`normalize_number`); None when it holds no number.

    Preference: the first `#### N` (GSM8K's form; a small model often rambles on into a new question
    afterwards, so the first one is its answer), else the last "The (final) answer is N", else the last
    number in the text.
    """
    hashes = _HASHES_RE.search(text)
    if hashes is not None:
        return _number_of(hashes)
    stated = list(_THE_ANSWER_RE.finditer(text))
    if stated:
        return _number_of(stated[-1])
    numbers = list(_NUMBER_RE.finditer(text))
    if numbers:
        return _number_of(numbers[-1])
    return None


def is_formatted(text: str) -> bool:
    """Whether `text` gives an answer in the `#### <number>` form."""
    return _HASHES_RE.search(text) is not None


def is_correct(predicted: str | None, gold: str | int) -> bool:
    """Whether a predicted answer equals the gold answer as a number ("1,000.0" equals 1000)."""
    if predicted is None:
        return False
    want = normalize_number(str(gold))
    got = normalize_number(predicted)
    return want is not None and got is not None and Decimal(got) == Decimal(want)


def reward(text: str, gold: str | int, format_bonus: float = DEFAULT_FORMAT_BONUS) -> float:
    """1.0 for a correct final answer, plus `format_bonus` when the answer is written as `#### N`
    (whether or not it is right); the most is 1.0 + format_bonus, the least 0.0."""
    if format_bonus < 0:
        raise ValueError(f"format_bonus must be >= 0, got {format_bonus}")
    correct = 1.0 if is_correct(extract_answer(text), gold) else 0.0
    formatted = format_bonus if is_formatted(text) else 0.0
    return correct + formatted
