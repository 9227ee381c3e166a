"""A Weights & Biases run: the run config once, each step's metrics at step = trainer step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.telemetry.base import MetricsSink, TelemetryError
from trainer.telemetry.config import WandbConfig


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as exc:
        raise TelemetryError(
            f"trainer.wandb is set but wandb is not installed ({exc}): pip install 'flywheel-rl[tracking]' "
            "(or wandb), or leave trainer.wandb unset"
        ) from exc
    return wandb


class WandbSink(MetricsSink):
    """One W&B run for this trainer process (`trainer.wandb`)."""

    name = "wandb"

    def __init__(self, config: WandbConfig, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        wandb = _wandb()
        directory = config.dir if config.dir is not None else run_dir
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.project, entity=config.entity, mode=config.mode, name=config.name,
            group=config.group, tags=list(config.tags) or None, id=config.run_id,
            resume="allow" if config.run_id is not None else None, dir=str(directory),
            config=dict(run_config), reinit="create_new",
        )

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
