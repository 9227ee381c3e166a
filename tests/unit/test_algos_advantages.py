"""Group baselines against hand-computed numbers, the group-of-one fallback, and turn discounts."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trainer.algos.advantages import (
    batch_baseline_advantages,
    compute_advantages,
    discounted_turn_returns,
    dr_grpo_advantages,
    grpo_advantages,
    rloo_advantages,
)

# Group "a" has 3 samples (1, 0, 0), "b" has 2 (2, 4), "c" is alone (5); ids are interleaved.
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 5.0])
GROUPS = ["a", "b", "a", "b", "a", "c"]
# Sample stds: group a: devs (2/3, -1/3, -1/3) → var (6/9)/2 = 1/3; group b: var 2/1 = 2;
# the whole batch (mean 2): devs (-1, 0, -2, 2, -2, 3) → var 22/5.
STD_A, STD_B, STD_BATCH = math.sqrt(1 / 3), math.sqrt(2), math.sqrt(22 / 5)


def test_grpo_by_hand() -> None:
    expected = [
        (1 - 1 / 3) / STD_A,
        (2 - 3) / STD_B,
        (0 - 1 / 3) / STD_A,
        (4 - 3) / STD_B,
        (0 - 1 / 3) / STD_A,
        (5 - 2) / STD_BATCH,
    ]
    got = grpo_advantages(REWARDS, GROUPS, eps=0.0)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)
    with_eps = grpo_advantages(REWARDS, GROUPS, eps=0.5)
    assert with_eps[0].item() == pytest.approx((1 - 1 / 3) / (STD_A + 0.5), abs=1e-6)


def test_dr_grpo_by_hand() -> None:
    expected = [1 - 1 / 3, 2 - 3, 0 - 1 / 3, 4 - 3, 0 - 1 / 3, 5 - 2]
    torch.testing.assert_close(dr_grpo_advantages(REWARDS, GROUPS), torch.tensor(expected), atol=1e-6, rtol=0)


def test_rloo_by_hand() -> None:
    # Leave-one-out means: a: (0+0)/2, (1+0)/2, (1+0)/2; b: 4, 2; c alone: batch others (1+2+0+4+0)/5.
    expected = [1 - 0, 2 - 4, 0 - 0.5, 4 - 2, 0 - 0.5, 5 - 7 / 5]
    torch.testing.assert_close(rloo_advantages(REWARDS, GROUPS), torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_of_one_gets_the_batch_baseline_and_a_warning(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.algos.advantages"):
        got = compute_advantages(REWARDS, GROUPS, kind, 1e-6)
    assert got[5].item() != 0.0
    assert any("alone in their group" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_no_warning_when_every_group_has_company(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.algos.advantages"):
        compute_advantages(REWARDS[:5], GROUPS[:5], kind, 1e-6)
    assert not caplog.records


def test_tensor_and_int_group_ids_match_string_ids() -> None:
    as_tensor = torch.tensor([7, 3, 7, 3, 7, 9])
    torch.testing.assert_close(rloo_advantages(REWARDS, as_tensor), rloo_advantages(REWARDS, GROUPS))
    torch.testing.assert_close(grpo_advantages(REWARDS, [7, 3, 7, 3, 7, 9]), grpo_advantages(REWARDS, GROUPS))


def test_a_batch_of_one_keeps_its_raw_reward(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        for kind in ("grpo", "dr_grpo", "rloo"):
            assert compute_advantages(torch.tensor([0.7]), ["only"], kind, 1e-6).tolist() == pytest.approx(
                [0.7]
            )
    assert caplog.records


def test_batch_baseline() -> None:
    torch.testing.assert_close(batch_baseline_advantages(REWARDS), REWARDS - 2.0)
    torch.testing.assert_close(
        batch_baseline_advantages(REWARDS, normalize_std=True, eps=0.0), (REWARDS - 2) / STD_BATCH
    )


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="differ"):
        grpo_advantages(REWARDS, GROUPS[:4])


def test_turn_discount_by_hand() -> None:
    # R2 = 2; R1 = 0 + 0.5·2 = 1; R0 = 1 + 0.5·1 = 1.5
    assert discounted_turn_returns([1.0, 0.0, 2.0], 0.5).tolist() == pytest.approx([1.5, 1.0, 2.0])
    assert discounted_turn_returns(torch.tensor([1.0, 0.0, 2.0]), 1.0).tolist() == pytest.approx(
        [3.0, 2.0, 2.0]
    )
    assert discounted_turn_returns([1.0, 0.0, 2.0], 0.0).tolist() == pytest.approx([1.0, 0.0, 2.0])
