"""Eval-gated promotion: the rule that decides whether a candidate version may be served.

The trainer records every new version as a candidate and hands its checkpoint to a `CandidateGate`,
which scores it on a held-out eval set on a worker of its own (never a serving worker) and answers an
`EvalResult`. `decide` compares that with the best promoted version's result: the candidate is promoted
when it is not worse by more than `margin` and, when `min_better_items` is set, it beats the best
version on at least that many items. Otherwise it is rejected: serving stays on (or rolls back to) the
best version, and training goes on from the best version's weights and optimiser state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from storage.records import EvalResult
from trainer.config import PromotionConfig


class CandidateGate(Protocol):
    """Evaluates a checkpoint on the eval set, off the serving workers."""

    async def evaluate(self, checkpoint_path: str, version: int) -> EvalResult: ...


@dataclass(frozen=True, slots=True)
class Decision:
    promote: bool
    reason: str


def better_items(candidate: EvalResult, best: EvalResult) -> int:
    """How many eval items (present in both) the candidate scores strictly higher on."""
    return sum(
        1
        for item, score in candidate.item_scores.items()
        if item in best.item_scores and score > best.item_scores[item]
    )


def decide(candidate: EvalResult, best: EvalResult | None, config: PromotionConfig) -> Decision:
    """Promote or reject `candidate` against the best promoted version's evaluation (None: nothing to
    compare with, so it is promoted)."""
    if best is None:
        return Decision(True, f"score {candidate.score:.4f}; no evaluated version to compare with")
    floor = best.score - config.margin
    if candidate.score < floor:
        return Decision(
            False,
            f"score {candidate.score:.4f} is below the best version's {best.score:.4f} minus margin "
            f"{config.margin:g}",
        )
    if config.min_better_items > 0:
        better = better_items(candidate, best)
        if better < config.min_better_items:
            return Decision(
                False,
                f"score {candidate.score:.4f} >= {floor:.4f}, but better on {better} items, fewer than "
                f"min_better_items={config.min_better_items}",
            )
    return Decision(
        True, f"score {candidate.score:.4f} >= best {best.score:.4f} minus margin {config.margin:g}"
    )
