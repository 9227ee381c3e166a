"""Prometheus metrics of one proxy app, on its own CollectorRegistry (never the global default, so any
number of apps can live in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _PrometheusCounter
from prometheus_client import Gauge as _PrometheusGauge
from prometheus_client import Histogram as _PrometheusHistogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _CachedLabels:
    """`labels(...)` answered from a plain dict once a child exists: prometheus_client's own takes a
    lock and rebuilds its key on every call, and a request makes about ten of them."""

    def labels(self, *values: Any, **kwargs: Any) -> Any:
        if kwargs:
            return super().labels(*values, **kwargs)  # type: ignore[misc]
        children: dict[tuple[Any, ...], Any] = self.__dict__.setdefault("_cached_children", {})
        child = children.get(values)
        if child is None:
            child = children[values] = super().labels(*values)  # type: ignore[misc]
        return child


class Counter(_CachedLabels, _PrometheusCounter):
    pass


class Gauge(_CachedLabels, _PrometheusGauge):
    pass


class Histogram(_CachedLabels, _PrometheusHistogram):
    pass


class ProxyMetrics:
    """Requests, tokens, latencies, worker health and recorder batches."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "flywheel_proxy_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "flywheel_proxy_request_seconds", "Time from request to the end of the response", ["route"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "flywheel_proxy_time_to_first_token_seconds", "Streaming: request to first content chunk",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "flywheel_proxy_tokens", "Tokens served", ["kind"], registry=self.registry
        )
        self.completions = Counter(
            "flywheel_proxy_completions", "Completions recorded", ["finish_reason"], registry=self.registry
        )
        self.worker_in_flight = Gauge(
            "flywheel_proxy_worker_in_flight", "Requests in flight per worker", ["worker"],
            registry=self.registry,
        )
        self.worker_errors = Counter(
            "flywheel_proxy_worker_errors", "Failed calls to workers", ["worker", "kind"],
            registry=self.registry,
        )
        self.record_batch_size = Histogram(
            "flywheel_proxy_record_batch_size", "Completions written per recorder transaction",
            buckets=_BATCH_BUCKETS, registry=self.registry,
        )
        self.record_seconds = Histogram(
            "flywheel_proxy_record_seconds", "Time of one recorder transaction",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.record_failures = Counter(
            "flywheel_proxy_record_failures", "Completions that could not be written", registry=self.registry
        )
        self.worker_up = Gauge(
            "flywheel_proxy_worker_up", "1 while a worker is in rotation, 0 while it is out", ["worker"],
            registry=self.registry,
        )
        self.sticky_routing = Counter(
            "flywheel_proxy_sticky_routing", "Routing decisions for sessions: hit (back to the session's "
            "worker), miss (that worker down or too busy), new (no worker yet)", ["result"],
            registry=self.registry,
        )
        self.resumes = Counter(
            "flywheel_proxy_generation_resumes", "Generations re-issued as prompt + tokens so far, by cause "
            "(abort: a weight push paused the worker; lost: the worker failed mid-request)", ["cause"],
            registry=self.registry,
        )
        self.conversation_turns = Counter(
            "flywheel_proxy_conversation_turns",
            "Chat calls of sessions by how their prompt was built: chained onto an earlier completion, "
            "chained onto one leaving out its trailing ephemeral context (ephemeral), a new root, or a "
            "branch (the client changed the session's history)",
            ["kind"], registry=self.registry,
        )
        self.conversation_drift = Counter(
            "flywheel_proxy_conversation_drift",
            "Chained prompts that differ from a fresh render of the same messages (a template that "
            "rewrites history, or retokenization drift the chaining avoided)",
            registry=self.registry,
        )
        self.database_up = Gauge(
            "flywheel_proxy_database_up", "1 while the database answers, 0 while the proxy refuses new work "
            "because it does not", registry=self.registry,
        )
        self.feedback = Counter(
            "flywheel_feedback", "User feedback stored (POST /rl/v1/feedback), by state: applied (it reaches "
            "training) or late (its trajectories were claimed or consumed already, or none trains it)",
            ["state"], registry=self.registry,
        )
        self.stream_disconnects = Counter(
            "flywheel_proxy_stream_disconnects", "Streams the client dropped before the end",
            registry=self.registry,
        )
        self.admission_refused = Counter(
            "flywheel_proxy_admission_refused", "RL API session creations refused with 429 by admission "
            "control, by what was asked (session or group)", ["kind"], registry=self.registry,
        )
        self.admission_admitted = Gauge(
            "flywheel_proxy_admission_admitted", "Sessions holding an admission slot, as the last RL API "
            "creation found them", registry=self.registry,
        )
        self.admission_capacity = Gauge(
            "flywheel_proxy_admission_capacity", "(η + v + 1) · B at the last RL API creation",
            registry=self.registry,
        )
