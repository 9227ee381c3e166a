"""Algorithm configs: discriminated union, unknown keys rejected, registries checked at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainer.algos import advantages, losses
from trainer.algos.registries import check_registries
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
    check_registries()
    monkeypatch.delitem(registry, kind)
    with pytest.raises(ValueError, match=kind):
        check_registries()


def test_reading_a_config_does_not_load_torch() -> None:
    """The CLI and the proxy read the whole config; only the trainer and the engine need torch."""
    code = "import sys, flywheel.config; flywheel.config.FlywheelConfig(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
