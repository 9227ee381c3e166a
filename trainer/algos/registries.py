"""The check that every kind an algorithm config can name has a function registered behind it.

It imports the torch modules the functions live in, so it runs where training starts (the policy), not
where a config is read: reading a config (the CLI, the proxy) does not load torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import get_args

from pydantic import BaseModel

from trainer.algos.advantages import ADVANTAGE_FNS
from trainer.algos.config import AdvantageConfig, KLConfig, LossConfig
from trainer.algos.losses import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS


def _literal_values(model: type[BaseModel], field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


def _check_registry(name: str, kinds: set[str], registry: Mapping[str, object]) -> None:
    missing = kinds - set(registry)
    if missing:
        raise ValueError(f"no {name} registered for {sorted(missing)}; registered: {sorted(registry)}")


def check_registries() -> None:
    """Every kind a config can name has a function behind it; raise ValueError naming the gaps."""
    advantage_models = get_args(get_args(AdvantageConfig)[0])  # the union's members
    advantage_kinds = set().union(*(_literal_values(m, "kind") for m in advantage_models))
    _check_registry("advantage estimator", advantage_kinds, ADVANTAGE_FNS)
    _check_registry("ratio level", _literal_values(LossConfig, "ratio_level"), RATIO_LEVELS)
    _check_registry("loss aggregation", _literal_values(LossConfig, "aggregation"), AGGREGATIONS)
    _check_registry("KL estimator", _literal_values(KLConfig, "estimator"), KL_ESTIMATORS)
