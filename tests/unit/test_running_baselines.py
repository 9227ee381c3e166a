"""Running baselines for ungrouped samples: a group of one is measured against its key's earlier rewards,
never silently given a zero advantage."""

from __future__ import annotations

import pytest
import torch

from trainer.algos.baselines import ALL_KEYS, RunningBaselines, running_advantages, updated


def test_before_any_reward_the_advantage_is_the_reward_itself() -> None:
    advantages = running_advantages(torch.tensor([0.7]), ["task:a"], RunningBaselines())
    assert advantages.tolist() == pytest.approx([0.7])


def test_a_key_is_measured_against_its_own_history() -> None:
    baselines = updated(RunningBaselines(), ["task:a", "task:b"], [1.0, 0.0], decay=0.5)
    advantages = running_advantages(torch.tensor([1.0, 1.0]), ["task:a", "task:b"], baselines)
    assert advantages.tolist() == pytest.approx([0.0, 1.0])


def test_a_new_key_uses_the_average_over_all_keys() -> None:
    baselines = updated(RunningBaselines(), ["task:a", "task:b"], [1.0, 0.0], decay=0.5)
    assert baselines.baseline("task:new") == pytest.approx(baselines.means[ALL_KEYS])
    assert baselines.baseline(None) == pytest.approx(baselines.means[ALL_KEYS])


def test_the_average_moves_by_one_minus_decay() -> None:
    baselines = updated(RunningBaselines(), ["k"], [1.0], decay=0.9)
    baselines = updated(baselines, ["k"], [0.0], decay=0.9)
    assert baselines.means["k"] == pytest.approx(0.9)
    assert baselines.counts["k"] == 2


def test_state_round_trips_through_a_dict() -> None:
    baselines = updated(RunningBaselines(), ["k", None], [1.0, 0.5], decay=0.8)
    assert RunningBaselines.from_dict(baselines.as_dict()) == baselines


def test_a_decay_of_one_is_refused() -> None:
    with pytest.raises(ValueError, match="decay"):
        updated(RunningBaselines(), ["k"], [1.0], decay=1.0)
