"""Answer extraction and voting for the Scaffolding layer's controllers: the majority answer of several
samples, and the best sample by score."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def extract_boxed(text: str | None) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (balanced braces), else None."""
    if not text:
        return None
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def majority_answer(answers: Sequence[str | None]) -> tuple[int, str | None]:
    """(index of the first sample giving the most frequent answer, that answer). None answers do not
    vote; a tie goes to the answer given first. (0, None) when no sample gave an answer."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return 0, None
    top = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == top)
    return answers.index(winner), winner


def digit_majority(texts: Sequence[str | None]) -> tuple[int, str | None]:
    """Majority vote over the `\\boxed{}` answers that are plain digits (the upstream default vote)."""
    answers = [a if a is not None and a.isdigit() else None for a in map(extract_boxed, texts)]
    return majority_answer(answers)


def best_index(scores: Sequence[float | None]) -> int:
    """Index of the highest score, the first on a tie; None and NaN rank lowest. ValueError when empty."""
    if not scores:
        raise ValueError("no scores to choose from")
    return max(range(len(scores)), key=lambda i: _rank(scores[i]))


def _rank(score: float | None) -> float:
    return -math.inf if score is None or math.isnan(score) else score
