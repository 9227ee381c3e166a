"""The trainer's metrics: one log line per step, one JSON line per step in `<run dir>/metrics.jsonl`
(the same numbers go into `train_steps.metrics` with the step's record), and the same to the Monitor's
sinks (Prometheus, TensorBoard, W&B, MLflow: trainer/telemetry/), with what the driver tells it between
steps (claims, weight pushes)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainer.telemetry.base import MetricsSink

logger = logging.getLogger(__name__)

# (metric, label, format) shown in the one-line summary, when present.
_SUMMARY = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/std", "±", "{:.3f}"),
    ("loss", "loss", "{:.4f}"),
    ("kl/prox_theta", "kl", "{:.2e}"),
    ("clip/clip_high_frac", "clip+", "{:.3f}"),
    ("clip/clip_low_frac", "clip-", "{:.3f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("grad_norm", "|g|", "{:.3f}"),
    ("staleness/max", "stale", "{:.0f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("perf/train_s", "train", "{:.2f}s"),
    ("perf/push_s", "push", "{:.2f}s"),
)


def finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The finite metrics as plain floats (JSON, and so Postgres, cannot hold NaN or ±inf); a warning
    names any left out."""
    clean = {name: float(value) for name, value in metrics.items() if math.isfinite(value)}
    dropped = sorted(set(metrics) - set(clean))
    if dropped:
        logger.warning("non-finite metrics left out: %s", ", ".join(f"{n}={metrics[n]}" for n in dropped))
    return clean


class Monitor:
    """Logs and appends each step's metrics; `history` keeps them in memory for the caller. Each sink is
    told the same; a sink that raises is logged once and dropped, so that no dashboard stops training."""

    def __init__(self, metrics_path: Path | None, sinks: Sequence[MetricsSink] = ()) -> None:
        self._path = metrics_path
        if metrics_path is not None:
            metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, float]] = []
        self.sinks = list(sinks)

    def record(self, step: int, version: int, metrics: Mapping[str, float]) -> dict[str, float]:
        """Log one line, append one JSON line; returns the JSON-safe metrics."""
        clean = finite_metrics(metrics)
        self.history.append(clean)
        logger.info("step %d → v%d | %s", step, version, summary(clean))
        if self._path is not None:
            line = json.dumps({"step": step, "policy_version": version, "time": time.time(), **clean})
            with self._path.open("a", encoding="utf-8") as out:
                out.write(line + "\n")
        self._tell("log_step", step, version, clean)
        return clean

    def claimed(self, samples: int, dropped: int) -> None:
        """A claim got `samples` trajectories (0: none to train on) and dropped `dropped` as stale."""
        self._tell("log_claim", samples, dropped)

    def pushed(self, version: int, seconds: float) -> None:
        """The workers were given `version` (a push that took `seconds`): they now serve it."""
        self._tell("log_push", version, seconds)
        self._tell("log_served", version)

    def served(self, version: int) -> None:
        """The workers serve `version` (found so at start, with nothing to push)."""
        self._tell("log_served", version)

    def push_failed(self) -> None:
        self._tell("log_push_failure")

    def close(self) -> None:
        """Close every sink (at the end of the run)."""
        self._tell("close")
        self.sinks = []

    def _tell(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception:
                logger.exception("the %s metrics sink failed (%s); it is off for the rest of the run",
                                 sink.name, method)
                self.sinks.remove(sink)


def summary(metrics: Mapping[str, float]) -> str:
    """The headline metrics of a step on one line."""
    shown = [(label, fmt, metrics[name]) for name, label, fmt in _SUMMARY if name in metrics]
    return " ".join(f"{label} {fmt.format(value)}" for label, fmt, value in shown)
