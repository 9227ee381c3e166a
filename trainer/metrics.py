"""The trainer's Prometheus metrics (`TrainerMetrics`, on a registry of its own) and their HTTP endpoint
(`trainer.metrics_port`). It is one of the Monitor's sinks, so it sees exactly what metrics.jsonl gets,
plus what the driver tells the Monitor between steps: claims, pushes, the served version. Every series
is described in docs/metrics.md."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from serving.client import SGLangClient
from trainer.monitor import Monitor
from trainer.telemetry.base import MetricsSink
from trainer.weights.sync import WeightSync

logger = logging.getLogger(__name__)

_STEP_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_PUSH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# Gauges set from a step's metrics when it has them: (series, step metric).
_GAUGES = (
    ("flywheel_trainer_reward_mean", "reward/mean", "Mean reward of the last step's samples"),
    ("flywheel_trainer_loss", "loss", "Policy loss of the last step"),
    ("flywheel_trainer_grad_norm", "grad_norm", "Global gradient L2 norm of the last step (before clipping)"),
    ("flywheel_trainer_entropy", "entropy", "Mean token entropy of the last step"),
    ("flywheel_trainer_tokens_per_second", "perf/tokens_per_s", "Tokens trained per second in the last step"),
)
_KL = {"kl/prox_theta": "prox_theta", "kl/behave_theta": "behave_theta", "kl/ref": "ref"}
_STALENESS = {"staleness/mean": "mean", "staleness/max": "max"}


class TrainerMetrics(MetricsSink):
    """Steps, versions, the headline step metrics, samples and tokens trained, claims, step and push times
    and push failures; every finite step metric also as `flywheel_trainer_step_metric{name=...}`."""

    name = "prometheus"

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.steps = Counter("flywheel_trainer_steps", "Training steps recorded", registry=registry)
        self.policy_version = Gauge("flywheel_trainer_policy_version",
                                    "Policy version the last step produced", registry=registry)
        self.served_version = Gauge("flywheel_trainer_served_version",
                                    "Policy version the serving workers were last given", registry=registry)
        self.last_step = Gauge("flywheel_trainer_last_step_timestamp_seconds",
                               "Unix time the last step was recorded", registry=registry)
        self._gauges = {metric: Gauge(series, doc, registry=registry) for series, metric, doc in _GAUGES}
        self.kl = Gauge("flywheel_trainer_kl", "KL estimates of the last step: prox_theta (π_prox ‖ π_θ), "
                        "behave_theta (behaviour policy ‖ π_θ), ref (reference ‖ π_θ, with a KL penalty)",
                        ["estimate"], registry=registry)
        self.staleness = Gauge("flywheel_trainer_staleness", "Staleness of the last step's samples (current "
                               "version − oldest version of a sample's trained tokens), mean and max",
                               ["stat"], registry=registry)
        self.step_metric = Gauge("flywheel_trainer_step_metric", "Every finite metric of the last step, by "
                                 "its name in metrics.jsonl", ["name"], registry=registry)
        self.samples = Counter("flywheel_trainer_samples_trained", "Trajectories trained on",
                               registry=registry)
        self.tokens = Counter("flywheel_trainer_tokens_trained", "Tokens trained on (loss-masked)",
                              registry=registry)
        self.claims = Counter("flywheel_trainer_claims", "Claims of rewarded samples, by result: batch "
                              "(something to train on) or empty (the trainer waits for data)", ["result"],
                              registry=registry)
        self.dropped = Counter("flywheel_trainer_samples_dropped_stale", "Samples claims dropped as older "
                               "than max_head_offpolicyness", registry=registry)
        self.step_seconds = Histogram("flywheel_trainer_step_seconds", "Time of one step: train, save, push",
                                      buckets=_STEP_BUCKETS, registry=registry)
        self.push_seconds = Histogram("flywheel_trainer_push_seconds", "Time of one weight push to the "
                                      "workers", buckets=_PUSH_BUCKETS, registry=registry)
        self.push_failures = Counter("flywheel_trainer_weight_push_failures", "Weight pushes that failed",
                                     registry=registry)
        for result in ("batch", "empty"):
            self.claims.labels(result)
        self._server: tuple[WSGIServer, threading.Thread] | None = None
        self.port: int | None = None
        """The port /metrics is served on, once `serve` started it."""

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on `host`:`port` (0: a free port) in a daemon thread; returns the port."""
        self._server = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server[0].server_port)
        return self.port

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        self.steps.inc()
        self.policy_version.set(version)
        self.last_step.set(time.time())
        for metric, gauge in self._gauges.items():
            if metric in metrics:
                gauge.set(metrics[metric])
        for metric, label in _KL.items():
            if metric in metrics:
                self.kl.labels(label).set(metrics[metric])
        for metric, label in _STALENESS.items():
            if metric in metrics:
                self.staleness.labels(label).set(metrics[metric])
        for name, value in metrics.items():
            self.step_metric.labels(name).set(value)
        self.samples.inc(metrics.get("batch/trajectories", 0.0))
        self.tokens.inc(metrics.get("tokens/trained", 0.0))
        if "perf/step_s" in metrics:
            self.step_seconds.observe(metrics["perf/step_s"])

    def log_served(self, version: int) -> None:
        self.served_version.set(version)

    def log_claim(self, samples: int, dropped: int) -> None:
        self.claims.labels("batch" if samples else "empty").inc()
        self.dropped.inc(dropped)

    def log_push(self, version: int, seconds: float) -> None:
        self.push_seconds.observe(seconds)

    def log_push_failure(self) -> None:
        self.push_failures.inc()

    def close(self) -> None:
        """Stop serving /metrics."""
        if self._server is not None:
            server, thread = self._server
            self._server, self.port = None, None
            server.shutdown()
            server.server_close()
            thread.join(5)


def serve_trainer_metrics(metrics: TrainerMetrics, host: str, port: int) -> str:
    """Start the endpoint and say where it is (port 0 draws a free one); its URL."""
    bound = metrics.serve(host, port)
    url = f"http://{host}:{bound}/metrics"
    logger.info("trainer metrics (Prometheus) at %s", url)
    return url


class WatchedSync:
    """A weight push strategy whose pushes the Monitor hears about: the seconds and the served version of
    each one that worked, and each failure (re-raised as before)."""

    def __init__(self, inner: WeightSync, monitor: Monitor) -> None:
        self.inner = inner
        self._monitor = monitor

    async def push(self, clients: Sequence[SGLangClient], checkpoint_path: str, version: int) -> float:
        try:
            seconds = await self.inner.push(clients, checkpoint_path, version)
        except Exception:
            self._monitor.push_failed()
            raise
        self._monitor.pushed(version, seconds)
        return seconds
