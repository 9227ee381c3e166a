"""Math word problems for the demo agent: GSM8K from the Hugging Face Hub when it is reachable, a local
JSONL file in GSM8K's format, or offline a deterministic generator of GSM8K-style problems.

Train and held-out ("test") problems never overlap: GSM8K has its own test split; generated and JSONL
problems are assigned to a split by a hash (`split_of`), so the two are disjoint whatever their sizes
and seeds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from integrations.gsm8k.scoring import normalize_number

logger = logging.getLogger(__name__)

Source = Literal["auto", "gsm8k", "jsonl", "generated"]
Split = Literal["train", "test"]
SOURCES: tuple[str, ...] = ("auto", "gsm8k", "jsonl", "generated")
HELD_OUT_SHARE = 5
"""One generated or JSONL problem in this many (by question hash) is held out for evaluation."""
HUB_PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Problem:
    """One math word problem. `answer` is the gold final answer as a canonical number string ("72")."""

    question: str
    answer: str
    id: str
    solution: str = ""
    """A worked solution ending with its `#### <answer>` line, when the source has one."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Where it came from (`source`: gsm8k, jsonl, generated); for generated problems also the template
    name and its numbers."""

    def task(self) -> dict[str, Any]:
        """What the RL API stores as the session's task."""
        return {"problem_id": self.id, "question": self.question, "answer": self.answer}


def split_of(key: str) -> Split:
    """The split a problem belongs to (generated and JSONL sources), from a stable hash of its key: the
    question text of a JSONL problem; the template and numbers of a generated one, so a held-out
    problem is new arithmetic, not a known one with other names."""
    digest = hashlib.sha256(key.strip().encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0 else "train"


# ---- GSM8K's format ------------------------------------------------------------------------------


def parse_gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the number on its `#### N` line."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError(f"no '#### <answer>' line in solution: {solution[-80:]!r}")
    tail = solution[marker + 4 :].strip()
    answer = normalize_number(tail.splitlines()[0]) if tail else None
    if answer is None:
        raise ValueError(f"the '####' line holds no number: {solution[marker:][:80]!r}")
    return answer


def problem_from_row(row: dict[str, Any], problem_id: str, source: str = "jsonl") -> Problem:
    """A Problem from a GSM8K row `{"question": ..., "answer": "<solution>\\n#### N"}`."""
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, (str, int, float)):
        raise ValueError(f"a GSM8K row needs string 'question' and 'answer' fields, got keys {sorted(row)}")
    if isinstance(solution, str):
        answer = parse_gsm8k_answer(solution)
    else:  # a bare final answer
        answer = normalize_number(str(solution)) or ""
        if not answer:
            raise ValueError(f"not a number: {solution!r}")
        solution = f"#### {answer}"
    return Problem(question.strip(), answer, problem_id, solution=solution, meta={"source": source})


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file of GSM8K rows; blank lines are skipped, a bad line is an error that
    names it."""
    problems: list[Problem] = []
    name = Path(path).name
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                problems.append(problem_from_row(json.loads(line), f"{name}:{number}"))
            except (ValueError, AttributeError) as error:
                raise ValueError(f"{path}, line {number}: {error}") from error
    return problems


def _hub_unreachable_reason(timeout_s: float) -> str | None:
    """None when the Hub answers; else why not. A short probe, so an offline machine fails in seconds
    instead of waiting on the datasets library's own retries."""
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        response = httpx.head(f"{endpoint}/api/datasets/openai/gsm8k", timeout=timeout_s)
    except httpx.HTTPError as error:
        return f"the Hugging Face Hub at {endpoint} is unreachable ({type(error).__name__}: {error})"
    if response.status_code >= 500:
        return f"the Hugging Face Hub at {endpoint} answered HTTP {response.status_code}"
    return None


def load_gsm8k(
    split: Split = "train", *, probe: Callable[[float], str | None] | None = None,
    timeout_s: float = HUB_PROBE_TIMEOUT_S,
) -> list[Problem] | None:
    """GSM8K's `main` config via `datasets.load_dataset("openai/gsm8k", "main")`; None, with the reason
    logged, when the `datasets` package is missing or the Hub cannot be reached. With HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set the Hub is not probed and only a local cache can answer. `probe(timeout_s)`
    says why the Hub is unreachable, or None (default: a HEAD request to the Hub's API)."""
    try:
        import datasets  # optional: never a dependency of ours
    except ImportError as error:
        logger.warning("GSM8K unavailable: the `datasets` package is not installed (%s)", error)
        return None
    offline = any(os.environ.get(name) in {"1", "true", "True"}
                  for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline:
        reason = (probe or _hub_unreachable_reason)(timeout_s)
        if reason is not None:
            logger.warning("GSM8K unavailable: %s", reason)
            return None
    try:
        rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as error:  # the datasets library raises many types (network, cache, auth)
        logger.warning("GSM8K unavailable: load_dataset failed (%s: %s)", type(error).__name__, error)
        return None
    return [problem_from_row(dict(row), f"gsm8k-{split}-{i}", "gsm8k") for i, row in enumerate(rows)]


# ---- the offline generator -----------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kofi",
          "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "eggs",
          "balloons", "oranges", "stamps")


@dataclass(frozen=True)
class _Draw:
    """What one template drew: the question, the worked steps and the answer."""

    template: str
    numbers: dict[str, int]
    question: str
    steps: str
    answer: int

    def split_key(self) -> str:
        return f"{self.template}:" + ",".join(f"{k}={v}" for k, v in sorted(self.numbers.items()))


def _add(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    a, b = rng.randint(2, top), rng.randint(1, top)
    q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    return _Draw("add", {"a": a, "b": b}, q, f"{name} has {a} + {b} = {a + b} {item}.", a + b)


def _remove(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    a = rng.randint(3, top + 2)
    b = rng.randint(1, a - 1)
    q = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?"
    return _Draw("remove", {"a": a, "b": b}, q, f"{name} has {a} - {b} = {a - b} {item} left.", a - b)


def _buy(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    count, price = rng.randint(2, max(2, top // 2)), rng.randint(1, max(2, top // 2))
    q = f"{name} buys {count} {item} that cost ${price} each. How many dollars does {name} spend?"
    steps = f"{name} spends {count} * {price} = {count * price} dollars."
    return _Draw("buy", {"count": count, "price": price}, q, steps, count * price)


def _share(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    friends, each = rng.randint(2, max(2, min(top, 6))), rng.randint(1, max(2, top // 2))
    total = friends * each  # exact division by construction
    q = (f"{name} has {total} {item} and shares them equally among {friends} friends. "
         f"How many {item} does each friend get?")
    steps = f"Each friend gets {total} / {friends} = {each} {item}."
    return _Draw("share", {"total": total, "friends": friends}, q, steps, each)


def _add_then_remove(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    a, b = rng.randint(2, top), rng.randint(1, top)
    c = rng.randint(1, a + b - 1)
    q = (f"{name} has {a} {item}, buys {b} more, and then gives {c} away. "
         f"How many {item} does {name} have now?")
    steps = f"{name} has {a} + {b} = {a + b} {item}, then {a + b} - {c} = {a + b - c} {item}."
    return _Draw("add_then_remove", {"a": a, "b": b, "c": c}, q, steps, a + b - c)


def _packs_then_use(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    packs, per_pack = rng.randint(2, max(2, top // 2)), rng.randint(2, max(2, top // 2))
    used = rng.randint(1, packs * per_pack - 1)
    q = (f"{name} buys {packs} packs of {item} with {per_pack} {item} in each pack and uses {used} of them. "
         f"How many {item} are left?")
    total = packs * per_pack
    left = total - used
    steps = f"{name} buys {packs} * {per_pack} = {total} {item}, then {total} - {used} = {left} are left."
    return _Draw("packs_then_use", {"packs": packs, "per_pack": per_pack, "used": used}, q, steps, left)


def _wage_then_spend(rng: random.Random, top: int, name: str, item: str) -> _Draw:
    rate, hours = rng.randint(2, max(2, top)), rng.randint(2, max(2, min(top, 8)))
    spent = rng.randint(1, rate * hours - 1)
    q = (f"{name} earns ${rate} an hour and works for {hours} hours. Then {name} spends ${spent} on {item}. "
         f"How many dollars does {name} have left?")
    earned = rate * hours
    left = earned - spent
    steps = f"{name} earns {rate} * {hours} = {earned} dollars, then {earned} - {spent} = {left} are left."
    return _Draw("wage_then_spend", {"rate": rate, "hours": hours, "spent": spent}, q, steps, left)


ONE_STEP = (_add, _remove, _buy, _share)
TWO_STEP = (_add_then_remove, _packs_then_use, _wage_then_spend)
TEMPLATES: dict[str, Callable[[random.Random, int, str, str], _Draw]] = {
    fn.__name__.lstrip("_"): fn for fn in (*ONE_STEP, *TWO_STEP)
}


def _difficulty_knobs(difficulty: int) -> tuple[int, float]:
    """(largest operand, share of two-step problems): 10 and 20 % at 1, then ×3 and +30 points a level."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    return 10 * 3 ** (difficulty - 1), min(0.9, 0.2 + 0.3 * (difficulty - 1))


def _draws(seed: int, difficulty: int) -> Iterator[_Draw]:
    top, two_step_share = _difficulty_knobs(difficulty)
    rng = random.Random(seed)
    while True:
        templates = TWO_STEP if rng.random() < two_step_share else ONE_STEP
        yield rng.choice(templates)(rng, top, rng.choice(_NAMES), rng.choice(_ITEMS))


def generate_problems(
    n: int, seed: int = 0, difficulty: int = 1, split: Split | None = None
) -> list[Problem]:
    """`n` distinct GSM8K-style problems, the same for the same arguments. At the default difficulty most
    are one step with operands up to 10. With `split`, only problems of that split (`split_of`)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    problems: list[Problem] = []
    seen: set[str] = set()
    for draw in _draws(seed, difficulty):
        if len(problems) >= n:
            break
        if draw.question in seen or (split is not None and split_of(draw.split_key()) != split):
            continue
        seen.add(draw.question)
        answer = str(draw.answer)
        problems.append(Problem(
            draw.question, answer, f"gen-{seed}-{difficulty}-{len(problems)}",
            solution=f"{draw.steps}\n#### {answer}",
            meta={"source": "generated", "template": draw.template, "numbers": dict(draw.numbers),
                  "difficulty": difficulty},
        ))
    return problems


# ---- choosing a source ---------------------------------------------------------------------------


def _sample(problems: Sequence[Problem], n: int | None, seed: int) -> list[Problem]:
    chosen = list(problems)
    random.Random(seed).shuffle(chosen)
    return chosen if n is None else chosen[:n]


def _split(problems: Iterable[Problem], split: Split | None) -> list[Problem]:
    return [p for p in problems if split is None or split_of(p.question) == split]


def load_problems(
    source: Source = "auto", path: str | Path | None = None, split: Split = "train",
    n: int | None = None, seed: int = 0, difficulty: int = 1, *, hash_split: bool = True,
) -> list[Problem]:
    """`n` problems (all of them when None, except for the endless generator) of `split`, shuffled by
    `seed`. "auto": GSM8K when the Hub answers, else generated. "jsonl" reads `path` and keeps the
    problems of `split` by question hash (`hash_split=False` keeps them all: a file that is a split
    already)."""
    if source not in SOURCES:
        raise ValueError(f"unknown problem source {source!r}; choose one of {', '.join(SOURCES)}")
    if source in ("auto", "gsm8k"):
        rows = load_gsm8k(split)
        if rows is not None:
            return _sample(rows, n, seed)
        if source == "gsm8k":
            raise RuntimeError("GSM8K could not be loaded (the log says why); use --source generated")
        logger.warning("falling back to generated problems")
        source = "generated"
    if source == "jsonl":
        if path is None:
            raise ValueError("source 'jsonl' needs a path")
        return _sample(_split(load_jsonl(path), split if hash_split else None), n, seed)
    if n is None:
        raise ValueError("generated problems need a count n")
    return generate_problems(n, seed=seed, difficulty=difficulty, split=split)
