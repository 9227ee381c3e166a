"""What the `math` hook runs in the pool's worker processes: module-level, picklable functions.

math-verify (and sympy under it) is imported inside the functions, so the proxy process that schedules
them never loads it. Its own SIGALRM timeouts are turned off: the pool enforces a hard per-item timeout by
killing the worker, which also stops sympy in the middle of C code, where an alarm would not.
"""

from __future__ import annotations

import logging
import re

# A run of two or more letters that is not a LaTeX command: the answer is prose ("18 dollars"), which
# math-verify reads best as it is; anything else ("1,234", "x^2+1", "\frac{1}{2}") is read as LaTeX math.
_PROSE_WORD = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}")
# A `$` that is a math delimiter (or a bare dollar sign), not LaTeX's escaped `\$`.
_DOLLAR = re.compile(r"(?<!\\)\$")


def as_math(answer: str) -> str:
    """`answer` in the form math-verify's `parse` reads best: bare math wrapped in `$…$` (its LaTeX
    extraction, which knows `1,234` is a number and `x^2` a power); text that already has a `$` (a
    delimiter or a currency sign) or prose words as it is."""
    body = answer.strip()
    if not body or _DOLLAR.search(body) or _PROSE_WORD.search(body):
        return body
    return f"${body}$"


def answers_match(gold: str, predicted: str) -> bool:
    """Whether `predicted` is mathematically the `gold` answer (math-verify: numbers, fractions,
    LaTeX expressions, sets…). Runs with no timeout of its own: call it through the hook pool."""
    from math_verify import parse, verify

    # With its timeouts off math-verify warns once per process that the caller must enforce one: we do.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = parse(as_math(gold), parsing_timeout=None)
    predicted_parsed = parse(as_math(predicted), parsing_timeout=None)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))
