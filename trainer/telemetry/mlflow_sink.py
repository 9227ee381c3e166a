"""An MLflow run, through `MlflowClient` (never MLflow's process-global active run, which the trainer's
own code or a user's might hold): the run config as params once, each step's metrics at step = trainer
step, the run ended FINISHED at shutdown."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from trainer.telemetry.base import MetricsSink, TelemetryError
from trainer.telemetry.config import MlflowConfig

_PARAMS_PER_CALL = 100  # MLflow's limit on params in one log_batch
_PARAM_VALUE_MAX = 500  # well under every MLflow version's limit on a param's value
_KEY_CHARACTERS = re.compile(r"[^\w\-. /]")  # what MLflow allows in metric and param names


def flat_params(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Nested config as (`a.b.c`, str(value)) pairs, values cut to a length every MLflow store takes."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from flat_params(value, f"{name}.")
        else:
            yield mlflow_key(name), str(value)[:_PARAM_VALUE_MAX]


def mlflow_key(name: str) -> str:
    """`name` with the characters MLflow refuses in a key replaced by `_`."""
    return _KEY_CHARACTERS.sub("_", name)


def _client(tracking_uri: str | None) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise TelemetryError(
            f"trainer.mlflow is set but mlflow is not installed ({exc}): pip install 'flywheel-rl[tracking]' "
            "(or mlflow-skinny), or leave trainer.mlflow unset"
        ) from exc
    return MlflowClient(tracking_uri=tracking_uri)


class MlflowSink(MetricsSink):
    """One MLflow run for this trainer process (`trainer.mlflow`)."""

    name = "mlflow"

    def __init__(self, config: MlflowConfig, run_config: Mapping[str, Any]) -> None:
        self._client = client = _client(config.tracking_uri)  # first: says what to install when missing
        from mlflow.entities import Param

        experiment = client.get_experiment_by_name(config.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(config.experiment)
        run = client.create_run(experiment_id, run_name=config.run_name, tags=dict(config.tags))
        self.run_id: str = run.info.run_id
        params = [Param(key, value) for key, value in flat_params(run_config)]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=params[start:start + _PARAMS_PER_CALL])

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(mlflow_key(name), value, now_ms, step) for name, value in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")
