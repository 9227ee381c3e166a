"""The numbers a train step reports, and the weight of each micro-batch in gradient accumulation.

Gradient accumulation must give the update one pass over the whole minibatch would give. A loss
aggregated over a micro-batch has the micro-batch's denominator, so each micro-batch's loss is scaled
by its share of the minibatch's denominator (e.g. its masked tokens / the minibatch's for token_mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from trainer.batching import PAD_VERSION, TrainBatch


def _token_share(part: Tensor, whole: Tensor) -> float:
    return float(part.sum()) / max(float(whole.sum()), 1.0)


def _sequence_share(part: Tensor, whole: Tensor) -> float:
    return float((part.sum(-1) > 0).sum()) / max(float((whole.sum(-1) > 0).sum()), 1.0)


def _row_share(part: Tensor, whole: Tensor) -> float:
    return part.shape[0] / max(whole.shape[0], 1)


MICRO_BATCH_WEIGHTS: dict[str, Callable[[Tensor, Tensor], float]] = {
    "token_mean": _token_share,  # Σ tokens / N: each part's mean times its share of N
    "seq_mean_token_mean": _sequence_share,  # mean over sequences that have a trained token
    "token_sum_norm": _row_share,  # Σ tokens / (B · max_tokens), with max_tokens fixed per minibatch
}
"""Weight of a micro-batch's aggregated loss, by `LossConfig.aggregation`: `(part_mask, whole_mask)`."""


def micro_batch_weight(aggregation: str, part_mask: Tensor, whole_mask: Tensor) -> float:
    """The factor that makes Σ_parts weight · loss(part) equal loss(whole) for this aggregation."""
    return MICRO_BATCH_WEIGHTS[aggregation](part_mask, whole_mask)


class StatsAccumulator:
    """Combines per-pass statistics: weighted means, except keys whose last part starts with `max`."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._maxima: dict[str, float] = {}

    def add_means(self, stats: Mapping[str, Tensor | float], weight: float) -> None:
        for name, value in stats.items():
            number = float(value)
            if name.rsplit("/", 1)[-1].startswith("max"):
                self._maxima[name] = max(self._maxima.get(name, -math.inf), number)
            elif weight > 0:
                self._sums[name] = self._sums.get(name, 0.0) + number * weight
                self._weights[name] = self._weights.get(name, 0.0) + weight

    def result(self) -> dict[str, float]:
        out = {name: total / self._weights[name] for name, total in self._sums.items()}
        out.update(self._maxima)
        return out


def batch_stats(batch: TrainBatch, advantages: Tensor, current_version: int) -> dict[str, float]:
    """Rewards, advantages, sizes and staleness (current version − a sample's oldest generated token)."""
    generated = batch.loss_mask & (batch.versions >= 0)  # (B, T-1)
    oldest = torch.where(generated, batch.versions, current_version).min(dim=1).values  # (B,)
    staleness = (current_version - oldest).float()  # (B,)
    rewards = batch.rewards.float()
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "advantage/mean": float(advantages.mean()),
        "advantage/std": float(advantages.std()) if len(advantages) > 1 else 0.0,
        "advantage/min": float(advantages.min()),
        "advantage/max": float(advantages.max()),
        "staleness/mean": float(staleness.mean()),
        "staleness/max": float(staleness.max()),
        "batch/trajectories": float(len(batch)),
        "batch/groups": float(len(set(batch.group_ids))),
        "tokens/trained": float(batch.num_tokens),
        "tokens/total": float((batch.versions != PAD_VERSION).sum() + len(batch)),
        "temperature/mean": float(batch.temperatures.mean()),
    }
