"""Token-budget packing of micro-batches and the ranks' shares of a minibatch (trainer/packing.py), and a
policy that packs by tokens taking the update of one pass over the whole minibatch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.ray_nodes import synthetic_samples
from trainer.config import AlgorithmConfig, LossConfig, TrainerConfig
from trainer.packing import pack_micro_batches, rank_share
from trainer.policy import Policy


def _random_lengths(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.integers(1, 60, int(rng.integers(1, 40)))]


def test_no_limit_is_one_micro_batch_in_the_given_order() -> None:
    assert pack_micro_batches([5, 9, 2]) == [[0, 1, 2]]
    assert pack_micro_batches([]) == []
    assert pack_micro_batches([], token_budget=10) == []


def test_rows_are_packed_longest_first_within_the_budget() -> None:
    # 30 alone (30 > 24); then 12+11 (2 × 12 = 24); then 8+8+3 (3 × 8 = 24); then 2.
    assert pack_micro_batches([3, 30, 8, 12, 2, 11, 8], token_budget=24) == [[1], [3, 5], [2, 6, 0], [4]]


def test_a_row_longer_than_the_budget_goes_alone() -> None:
    assert pack_micro_batches([50, 40, 3], token_budget=10) == [[0], [1], [2]]


def test_max_rows_caps_micro_batches_with_or_without_a_budget() -> None:
    assert pack_micro_batches([1, 2, 3, 4, 5], max_rows=2) == [[4, 3], [2, 1], [0]]
    assert pack_micro_batches([4, 4, 4, 4], token_budget=100, max_rows=3) == [[0, 1, 2], [3]]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("budget", [1, 16, 64, 500])
def test_every_row_once_and_every_packed_micro_batch_within_budget(seed: int, budget: int) -> None:
    lengths = _random_lengths(seed)
    parts = pack_micro_batches(lengths, token_budget=budget)
    assert sorted(p for part in parts for p in part) == list(range(len(lengths)))
    for part in parts:
        assert len(part) == 1 or len(part) * max(lengths[p] for p in part) <= budget


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_rank_shares_split_the_rows_evenly(seed: int, world_size: int) -> None:
    lengths = _random_lengths(seed)
    shares = [rank_share(lengths, rank, world_size) for rank in range(world_size)]
    assert sorted(p for share in shares for p in share) == list(range(len(lengths)))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(share == sorted(share) for share in shares)
    tokens = [sum(lengths[p] for p in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(lengths)  # the snake deal keeps token counts close


def test_rank_shares_deal_longest_first_in_a_snake() -> None:
    assert [rank_share([10, 9, 8, 7], rank, 2) for rank in range(2)] == [[0, 3], [1, 2]]  # 17 tokens each
    assert rank_share([4, 5, 6], 0, 1) == [0, 1, 2]


def test_fewer_rows_than_ranks_leaves_ranks_without_rows() -> None:
    assert [rank_share([7, 3], rank, 4) for rank in range(4)] == [[0], [1], [], []]
    with pytest.raises(ValueError):
        rank_share([1], 2, 2)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_token_budget_micro_batches_accumulate_to_the_whole_minibatch_update(
    tiny_model_dir: Path, aggregation: str
) -> None:
    samples = synthetic_samples(7, seed=0)
    algorithm = AlgorithmConfig(loss=LossConfig(aggregation=aggregation))
    config = TrainerConfig(lr=1e-2, grad_clip=None, algorithm=algorithm)
    whole = Policy(str(tiny_model_dir), config)
    packed = Policy(str(tiny_model_dir), config.model_copy(update={"micro_batch_tokens": 40}))
    whole_stats = whole.train_step(samples, 0)
    packed_stats = packed.train_step(samples, 0)
    assert packed_stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5, abs=1e-7)
    assert packed_stats["grad_norm"] == pytest.approx(whole_stats["grad_norm"], rel=1e-5)
    whole_grads = dict(whole._model.named_parameters())
    for name, param in packed._model.named_parameters():  # the gradients the step left on the parameters
        expected = whole_grads[name].grad
        assert param.grad is not None and expected is not None
        assert torch.allclose(param.grad, expected, rtol=1e-4, atol=1e-7), name
