"""What a metrics sink is told. The `Monitor` (trainer/monitor.py) is the one place that feeds sinks, and
it drops a sink whose call raised: a broken dashboard never stops training."""

from __future__ import annotations

from collections.abc import Mapping


class TelemetryError(RuntimeError):
    """A configured sink cannot be used (its library is not installed); said before training starts."""


class MetricsSink:
    """Receives the trainer's metrics; every method is a no-op here, so a sink overrides what it uses."""

    name = "sink"

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        """One training step's finite metrics, as metrics.jsonl has them."""

    def log_served(self, version: int) -> None:
        """The serving workers now serve `version`."""

    def log_claim(self, samples: int, dropped: int) -> None:
        """A claim got `samples` trajectories (0: nothing to train on yet) and dropped `dropped` as stale."""

    def log_push(self, version: int, seconds: float) -> None:
        """`version` reached the workers in `seconds`."""

    def log_push_failure(self) -> None:
        """A weight push failed."""

    def close(self) -> None:
        """The run is over: flush and release what the sink holds."""
