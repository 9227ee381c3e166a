"""Running reward baselines for samples without a group (live traffic: one conversation, one sample).

A group of one has no baseline of its own, and a batch of one has none either: the advantage would be
zero, or the raw reward. A running baseline remembers what earlier rewards of the same key (a task, an
online key) were: each key keeps an exponential moving average of its rewards, and a sample's advantage
is its reward minus its key's average before this batch (a key never seen uses the average over every
key, and 0 before any reward at all). Pure functions: the policy owns the state and saves it with its
optimiser state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

ALL_KEYS = "*"
"""The average over every key: the baseline of a key seen for the first time."""


@dataclass(frozen=True, slots=True)
class RunningBaselines:
    """Each key's moving average of rewards, and how many rewards it has seen."""

    means: Mapping[str, float] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)

    def baseline(self, key: str | None) -> float:
        for candidate in (key, ALL_KEYS):
            if candidate is not None and candidate in self.means:
                return self.means[candidate]
        return 0.0

    def as_dict(self) -> dict[str, dict[str, float] | dict[str, int]]:
        return {"means": dict(self.means), "counts": dict(self.counts)}

    @classmethod
    def from_dict(cls, state: Mapping[str, Mapping[str, float]]) -> RunningBaselines:
        return cls(
            means={str(k): float(v) for k, v in state.get("means", {}).items()},
            counts={str(k): int(v) for k, v in state.get("counts", {}).items()},
        )


def updated(
    baselines: RunningBaselines, keys: Sequence[str | None], rewards: Sequence[float], decay: float
) -> RunningBaselines:
    """The baselines after seeing `rewards` (one per key, in order): a key's first reward becomes its
    mean; later ones move it by `1 - decay`. Every reward also updates the average over all keys."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    means, counts = dict(baselines.means), dict(baselines.counts)
    for key, reward in zip(keys, rewards, strict=True):
        for name in {key or ALL_KEYS, ALL_KEYS}:
            seen = counts.get(name, 0)
            means[name] = float(reward) if seen == 0 else decay * means[name] + (1.0 - decay) * float(reward)
            counts[name] = seen + 1
    return RunningBaselines(means=means, counts=counts)


def running_advantages(rewards: Tensor, keys: Sequence[str | None], baselines: RunningBaselines) -> Tensor:
    """`r_i - baseline(key_i)` for each sample (N,), with the baselines from before this batch."""
    if rewards.shape != (len(keys),):
        raise ValueError(f"rewards {tuple(rewards.shape)} and {len(keys)} keys differ")
    base = torch.tensor([baselines.baseline(key) for key in keys], dtype=rewards.dtype, device=rewards.device)
    return rewards - base  # (N,)
