"""Prometheus metrics of reward hook runs, on the registry they are given (the proxy's, or a `flywheel
rewards` process's own)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class HookMetrics:
    """Hook job runs by source and outcome ("done", "retry", "failed", "lost"), how long they took, and the
    jobs a runner holds now."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.runs = Counter(
            "flywheel_reward_hook_runs", "Reward hook job runs, by hook source and outcome",
            ["source", "outcome"], registry=self.registry,
        )
        self.failures = Counter(
            "flywheel_reward_hook_failures", "Reward hook jobs that gave up (failed for good)",
            ["source"], registry=self.registry,
        )
        self.seconds = Histogram(
            "flywheel_reward_hook_seconds", "Time one run of a reward hook job took", ["source"],
            buckets=_SECONDS_BUCKETS, registry=self.registry,
        )
        self.jobs_in_flight = Gauge(
            "flywheel_reward_hook_jobs_in_flight", "Reward hook jobs this runner holds: running, or waiting "
            "for a worker of its process pool", registry=self.registry,
        )

    def track_jobs(self, count: Callable[[], int]) -> None:
        """Read the jobs in flight from `count` at scrape time (the runner's own set of job tasks), so that
        running a job costs the gauge nothing."""
        self.jobs_in_flight.set_function(count)

    def observe(self, source: str, outcome: str, seconds: float) -> None:
        self.runs.labels(source, outcome).inc()
        if outcome == "failed":
            self.failures.labels(source).inc()
        self.seconds.labels(source).observe(seconds)
