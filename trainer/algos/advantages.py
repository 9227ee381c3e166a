"""Advantages from rewards: group baselines (GRPO, Dr.GRPO, RLOO), the batch fallback, turn discounts.

Every estimator takes `rewards (N,)` and `group_ids` (N hashable ids, groups of any size) and returns
advantages `(N,)`. A sample alone in its group has no group baseline; subtracting its own reward would
turn it into a zero advantage and silently drop it (AReaL bug #1473). Such samples are logged and
take the same estimator computed over the whole batch instead.

Standard deviations are sample standard deviations (Bessel's correction, `n - 1`), as in the reference
GRPO implementations (TRL, OpenRLHF: `tensor.std()`); they are defined for every group of two or more,
and groups of one never reach them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

GroupIds = Sequence[Hashable] | Tensor
AdvantageFn = Callable[[Tensor, GroupIds, float], Tensor]
"""`(rewards (N,), group_ids (N,), eps) -> advantages (N,)`."""


def group_index(group_ids: GroupIds, device: torch.device | None = None) -> Tensor:  # (N,)
    """Dense group indices 0..G-1 (in order of first appearance) for arbitrary hashable ids."""
    if isinstance(group_ids, Tensor):
        _, index = torch.unique(group_ids, return_inverse=True)
        return index.to(device or group_ids.device)
    dense: dict[Hashable, int] = {}
    index_list = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index_list, dtype=torch.long, device=device)


def _group_stats(rewards: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (count, mean, sample std) of the sample's group, each (N,)."""
    num_groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, index, torch.ones_like(rewards)
    )  # (G,)
    mean = torch.zeros_like(count).index_add_(0, index, rewards) / count  # (G,)
    sq_dev = torch.zeros_like(count).index_add_(0, index, (rewards - mean[index]) ** 2)  # (G,)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()  # (G,) sample std; 0 for groups of one
    return count[index], mean[index], std[index]


def _with_batch_fallback(
    rewards: Tensor, group_ids: GroupIds, estimate: Callable[[Tensor, Tensor], Tensor], name: str
) -> Tensor:
    """Apply `estimate(rewards, index)` per group; samples alone in their group use the whole batch."""
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (N,)
    index = group_index(group_ids, rewards.device)  # (N,)
    if index.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({index.numel()},) differ")
    advantages = estimate(rewards, index)  # (N,)
    count, _, _ = _group_stats(rewards, index)
    alone = count == 1  # (N,)
    if alone.any():
        num_alone = int(alone.sum())
        logger.warning(
            "%s: %d of %d samples are alone in their group; using the batch baseline for them",
            name,
            num_alone,
            rewards.numel(),
        )
        if rewards.numel() == 1:
            # No other sample anywhere: no baseline exists, so keep the raw reward rather than zero.
            return rewards.clone()
        batch_advantages = estimate(rewards, torch.zeros_like(index))  # (N,)
        advantages = torch.where(alone, batch_advantages, advantages)
    return advantages


def _grpo(eps: float) -> Callable[[Tensor, Tensor], Tensor]:
    def estimate(rewards: Tensor, index: Tensor) -> Tensor:
        _, mean, std = _group_stats(rewards, index)
        return (rewards - mean) / (std + eps)

    return estimate


def _dr_grpo(rewards: Tensor, index: Tensor) -> Tensor:
    _, mean, _ = _group_stats(rewards, index)
    return rewards - mean


def _rloo(rewards: Tensor, index: Tensor) -> Tensor:
    count, mean, _ = _group_stats(rewards, index)
    # r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean); n >= 2 wherever this value is kept.
    return count / (count - 1).clamp(min=1) * (rewards - mean)


def grpo_advantages(rewards: Tensor, group_ids: GroupIds, eps: float = 1e-6) -> Tensor:  # (N,)
    """GRPO (Shao et al. 2024): `(r - mean_g) / (std_g + eps)`, sample std within the group.

    Departs from the paper: groups of one use the batch mean and std (the paper assumes G >= 2).
    """
    return _with_batch_fallback(rewards, group_ids, _grpo(eps), "grpo")


def dr_grpo_advantages(rewards: Tensor, group_ids: GroupIds, eps: float = 1e-6) -> Tensor:  # (N,)
    """Dr.GRPO (Liu et al. 2025): `r - mean_g`, no std division (`eps` is unused).

    Departs from the paper: groups of one use the batch mean.
    """
    return _with_batch_fallback(rewards, group_ids, _dr_grpo, "dr_grpo")


def rloo_advantages(rewards: Tensor, group_ids: GroupIds, eps: float = 1e-6) -> Tensor:  # (N,)
    """RLOO (Ahmadian et al. 2024): `r_i - mean_{j != i, j in g} r_j` (`eps` is unused).

    Departs from the paper: groups of one use the leave-one-out mean over the whole batch.
    """
    return _with_batch_fallback(rewards, group_ids, _rloo, "rloo")


def batch_baseline_advantages(rewards: Tensor, normalize_std: bool = False, eps: float = 1e-6) -> Tensor:
    """The whole batch as one group: `r - mean_batch`, divided by `std_batch + eps` if `normalize_std`.

    A batch of one sample keeps its raw reward (there is no baseline to subtract).
    """
    group_ids = torch.zeros(rewards.shape, dtype=torch.long, device=rewards.device)
    if normalize_std:
        return grpo_advantages(rewards, group_ids, eps)
    return dr_grpo_advantages(rewards, group_ids, eps)


ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}
"""Advantage estimators by `AdvantageConfig.kind`; `AlgorithmConfig` checks it covers every kind."""


def compute_advantages(rewards: Tensor, group_ids: GroupIds, kind: str, eps: float) -> Tensor:  # (N,)
    """The estimator registered under `kind`, applied to `rewards (N,)` grouped by `group_ids`."""
    return ADVANTAGE_FNS[kind](rewards, group_ids, eps)


def discounted_turn_returns(rewards: Tensor | Sequence[float], gamma: float) -> Tensor:  # (K,)
    """Per-completion returns of one session: `R_i = r_i + gamma * R_{i+1}`, walking back from the last.

    `rewards[i]` is the reward of the session's i-th completion in call order. `gamma = 1` gives each
    turn the sum of its own and all later rewards; `gamma = 0` keeps each turn's own reward.
    """
    rewards = torch.as_tensor(rewards)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))  # (K,)
    returns = torch.empty_like(rewards)  # (K,)
    running = rewards.new_zeros(())
    for i in range(rewards.numel() - 1, -1, -1):
        running = rewards[i] + gamma * running
        returns[i] = running
    return returns
