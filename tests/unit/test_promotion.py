"""The promotion rule: a candidate is served only if its evaluation is not worse than the best version's by
more than the margin (and, when asked, better on enough items)."""

from __future__ import annotations

from storage.records import EvalResult
from trainer.config import PromotionConfig
from trainer.promotion import better_items, decide


def _result(*scores: float) -> EvalResult:
    items = {str(i): score for i, score in enumerate(scores)}
    return EvalResult(score=sum(scores) / len(scores), item_scores=items)


def test_without_a_best_version_the_candidate_is_promoted() -> None:
    assert decide(_result(0.0, 0.0), None, PromotionConfig(enabled=True)).promote


def test_a_worse_candidate_is_rejected_and_the_reason_says_by_how_much() -> None:
    decision = decide(_result(0.2, 0.2), _result(0.5, 0.5), PromotionConfig(enabled=True))
    assert not decision.promote
    assert "0.2000" in decision.reason and "0.5000" in decision.reason


def test_the_margin_tolerates_a_small_drop_but_not_a_larger_one() -> None:
    config = PromotionConfig(enabled=True, margin=0.1)
    assert decide(_result(0.45, 0.45), _result(0.5, 0.5), config).promote
    assert not decide(_result(0.35, 0.35), _result(0.5, 0.5), config).promote


def test_an_equal_score_is_promoted_with_no_margin() -> None:
    assert decide(_result(0.5, 0.5), _result(0.5, 0.5), PromotionConfig(enabled=True)).promote


def test_min_better_items_needs_that_many_strictly_better_items() -> None:
    best = _result(0.5, 0.5, 0.5)
    config = PromotionConfig(enabled=True, min_better_items=2)
    assert better_items(_result(0.6, 0.5, 0.4), best) == 1
    assert not decide(_result(0.6, 0.5, 0.5), best, config).promote  # better on one item only
    assert decide(_result(0.6, 0.6, 0.5), best, config).promote


def test_items_missing_from_the_best_evaluation_do_not_count() -> None:
    best = EvalResult(score=0.5, item_scores={"a": 0.5})
    assert better_items(EvalResult(score=1.0, item_scores={"a": 1.0, "b": 1.0}), best) == 1
