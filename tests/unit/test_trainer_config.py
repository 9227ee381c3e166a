"""TrainerConfig: strict keys, nested algorithm selection, bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.config import RLOOAdvantageConfig, TrainerConfig


def test_defaults_are_synchronous_grpo_with_one_update_per_batch() -> None:
    config = TrainerConfig()
    assert config.max_head_offpolicyness == 0 and config.algorithm.advantage.kind == "grpo"
    assert config.ppo_epochs == config.minibatches == 1 and config.micro_batch_size is None
    assert config.weights.pause_mode == "abort" and config.ray.address is None


def test_nested_keys_parse_and_unknown_keys_fail() -> None:
    config = TrainerConfig.model_validate(
        {
            "algorithm": {"advantage": {"kind": "rloo"}, "loss": {"eps_clip_higher": 0.28}},
            "weights": {"pause_mode": "in_place"},
            "ray": {"num_cpus": 2},
            "betas": [0.9, 0.95],
        }
    )
    assert isinstance(config.algorithm.advantage, RLOOAdvantageConfig)
    assert config.weights.pause_mode == "in_place" and config.betas == (0.9, 0.95)
    for bad in ({"batch_sise": 8}, {"ray": {"adress": "auto"}}, {"weights": {"pause_mode": "soft"}}):
        with pytest.raises(ValidationError):
            TrainerConfig.model_validate(bad)


@pytest.mark.parametrize("field", ["batch_size", "lr", "ppo_epochs", "minibatches", "micro_batch_size"])
def test_sizes_and_rates_must_be_positive(field: str) -> None:
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate({field: 0})
    with pytest.raises(ValidationError):
        TrainerConfig(max_head_offpolicyness=-1)
