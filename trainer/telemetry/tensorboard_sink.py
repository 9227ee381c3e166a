"""TensorBoard event files (`torch.utils.tensorboard`): one scalar per metric per step, under
`<run dir>/tensorboard`; `tensorboard --logdir <run dir>/tensorboard` shows them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.telemetry.base import MetricsSink, TelemetryError

CONFIG_TAG = "run_config"
"""The text entry holding the run's config (JSON), written once at step 0."""


def _summary_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch raises this when the `tensorboard` package is missing
        raise TelemetryError(
            f"trainer.tensorboard needs the tensorboard package ({exc}): pip install tensorboard, or set "
            "trainer.tensorboard=false"
        ) from exc
    return SummaryWriter(log_dir=str(log_dir))


class TensorBoardSink(MetricsSink):
    """Each step's metrics as scalars at global step = trainer step, flushed at once (a step takes
    seconds, so a live dashboard is worth one small write per step)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, run_config: Mapping[str, Any]) -> None:
        self.log_dir = log_dir
        self._writer = _summary_writer(log_dir)
        # Markdown: four spaces make the JSON a code block.
        text = "\n".join("    " + line for line in json.dumps(run_config, indent=2, default=str).splitlines())
        self._writer.add_text(CONFIG_TAG, text, 0)
        self._writer.flush()

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
