"""The sinks a trainer's config asks for, opened before training starts.

A sink configured but whose library is missing stops the trainer at once with what to install (a
`TelemetryError`): it is a mistake in the config. A sink whose service cannot be reached (W&B offline,
an MLflow server down) is logged and left out: tracking is never a reason not to train."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainer.telemetry.base import MetricsSink, TelemetryError
from trainer.telemetry.config import MlflowConfig, WandbConfig

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
"""Under the run directory: the TensorBoard event files."""


def open_sinks(
    run_dir: Path,
    run_config: Mapping[str, Any],
    *,
    tensorboard: bool = False,
    wandb: WandbConfig | None = None,
    mlflow: MlflowConfig | None = None,
) -> list[MetricsSink]:
    """TensorBoard (`<run_dir>/tensorboard`), W&B and MLflow sinks, as configured, each given `run_config`
    once."""
    sinks: list[MetricsSink] = []
    if tensorboard:
        from trainer.telemetry.tensorboard_sink import TensorBoardSink

        _open(sinks, "TensorBoard", lambda: TensorBoardSink(run_dir / TENSORBOARD_DIR, run_config))
    if wandb is not None:
        from trainer.telemetry.wandb_sink import WandbSink

        _open(sinks, "Weights & Biases", lambda: WandbSink(wandb, run_dir, run_config))
    if mlflow is not None:
        from trainer.telemetry.mlflow_sink import MlflowSink

        _open(sinks, "MLflow", lambda: MlflowSink(mlflow, run_config))
    return sinks


def close_sinks(sinks: list[MetricsSink]) -> None:
    """Close each sink; one that fails to is logged, and the others are still closed."""
    for sink in sinks:
        try:
            sink.close()
        except Exception:
            logger.exception("closing the %s metrics sink failed", sink.name)


def _open(sinks: list[MetricsSink], what: str, make: Callable[[], MetricsSink]) -> None:
    try:
        sink = make()
    except TelemetryError:
        close_sinks(sinks)
        raise
    except Exception:
        logger.exception("%s logging could not start; training goes on without it", what)
        return
    logger.info("trainer metrics also go to %s", what)
    sinks.append(sink)
