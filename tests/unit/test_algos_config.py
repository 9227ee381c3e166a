"""Algorithm configs: discriminated union, unknown keys rejected, registries checked at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainer.algos import advantages, losses
from trainer.config import AlgorithmConfig, DrGRPOAdvantageConfig, LossConfig, RLOOAdvantageConfig


def test_advantage_kind_selects_the_config_class() -> None:
    config = AlgorithmConfig.model_validate({"advantage": {"kind": "rloo", "eps": 1e-4}})
    assert isinstance(config.advantage, RLOOAdvantageConfig) and config.advantage.eps == 1e-4
    assert isinstance(
        AlgorithmConfig.model_validate({"advantage": {"kind": "dr_grpo"}}).advantage, DrGRPOAdvantageConfig
    )
    assert AlgorithmConfig().advantage.kind == "grpo"
    with pytest.raises(ValidationError):
        AlgorithmConfig.model_validate({"advantage": {"kind": "ppo_gae"}})


def test_unknown_keys_and_bad_values_are_errors() -> None:
    with pytest.raises(ValidationError):
        LossConfig.model_validate({"eps_clp": 0.2})
    with pytest.raises(ValidationError):
        LossConfig.model_validate({"icepop": {"lower": 0.5, "upper": 5, "mid": 1}})
    with pytest.raises(ValidationError):
        LossConfig(dual_clip_c=0.9)  # must exceed 1
    with pytest.raises(ValidationError):
        LossConfig.model_validate({"kl": {"coef": 0.1, "estimator": "k4"}})


def test_nested_options_parse() -> None:
    loss = LossConfig.model_validate(
        {
            "icepop": {"lower": 0.5, "upper": 5},
            "kpop": {"upper": 0.1},
            "kl": {"coef": 0.01, "estimator": "k2"},
        }
    )
    assert loss.icepop is not None and loss.icepop.upper == 5
    assert loss.kpop is not None and loss.kpop.upper == 0.1
    assert loss.kl is not None and loss.kl.estimator == "k2"


@pytest.mark.parametrize(
    ("registry", "kind"),
    [
        (advantages.ADVANTAGE_FNS, "rloo"),
        (losses.AGGREGATIONS, "token_sum_norm"),
        (losses.RATIO_LEVELS, "sequence"),
        (losses.KL_ESTIMATORS, "k2"),
    ],
)
def test_a_kind_without_a_registered_function_fails_at_start_up(
    registry: dict, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    AlgorithmConfig()
    monkeypatch.delitem(registry, kind)
    with pytest.raises(ValueError, match=kind):
        AlgorithmConfig()
