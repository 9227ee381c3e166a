"""Prometheus metrics of one proxy app, on its own CollectorRegistry (never the global default, so any
number of apps can live in one process). Every series is described in docs/metrics.md.

What a request touches is a dict lookup at most (the proxy's per-call overhead is benchmarked): counters
and histograms through `_CachedLabels`, the requests in flight as a dict entry per request, and the
served policy version as a plain attribute; whatever needs more work is read when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _PrometheusCounter
from prometheus_client import Gauge as _PrometheusGauge
from prometheus_client import Histogram as _PrometheusHistogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

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


Scope = MutableMapping[str, Any]
"""An ASGI request scope: the router writes the matched route into it (`scope["route"]`)."""


def route_label(scope: Scope) -> str:
    """The route template a request matched (`/v1/chat/completions`, `/rl/v1/sessions/{session_id}/end`),
    never its raw path, so that the label's values stay few; "unmatched" before routing or for no route."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


class RequestsInFlight:
    """A collector of the requests being answered, by route: each request is a dict entry while it runs
    (`enter`, `leave`), and its route is read off its scope only when /metrics is scraped, since the
    router names it after the request-context middleware has started counting. A route once seen stays
    in the output at 0, so its series does not vanish between requests."""

    name = "flywheel_proxy_requests_in_flight"

    def __init__(self) -> None:
        self._scopes: dict[int, Scope] = {}
        self._seen: set[str] = set()

    def enter(self, scope: Scope) -> None:
        self._scopes[id(scope)] = scope

    def leave(self, scope: Scope) -> None:
        self._scopes.pop(id(scope), None)

    def counts(self) -> dict[str, int]:
        """Requests in flight now, by route (every route seen before included, at 0)."""
        counts = dict.fromkeys(self._seen, 0)
        for scope in list(self._scopes.values()):
            label = route_label(scope)
            counts[label] = counts.get(label, 0) + 1
        self._seen.update(counts)
        return counts

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for label, count in sorted(self.counts().items()):
            family.add_metric([label], count)
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, "Requests being answered (a stream until its last event), by "
                                 "route", labels=["route"])


class _PolicyVersion:
    """A collector of the policy version that generated the newest token the proxy recorded, read from a
    plain attribute the recorder sets; absent until the first completion is recorded."""

    name = "flywheel_proxy_policy_version"

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        if self._metrics.served_version is not None:
            family.add_metric([], self._metrics.served_version)
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, "Policy version of the newest token recorded: what the workers "
                                 "serve (0 = the initial weights)")


class ProxyMetrics:
    """Requests, tokens, latencies, worker health, recorder batches and queue, the served policy version."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "flywheel_proxy_requests", "HTTP requests answered, by route and status (429: rate limits and "
            "admission control)", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "flywheel_proxy_request_seconds", "Time from request to the end of the response, by route and "
            "status", ["route", "status"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self._request_children: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.in_flight = RequestsInFlight()
        self.registry.register(self.in_flight)
        self.served_version: int | None = None
        """The policy version of the newest token recorded (`saw_versions`), None before any."""
        self.registry.register(_PolicyVersion(self))
        self.record_queue = Gauge(
            "flywheel_proxy_record_queue", "Calls waiting for the recorder: queued, or in the transaction "
            "being written (read at scrape time)", registry=self.registry,
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

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its time: one dict lookup once its (route, status) was seen."""
        children = self._request_children.get((route, status))
        if children is None:
            code = str(status)
            children = self._request_children[(route, status)] = (
                self.requests.labels(route, code), self.latency.labels(route, code)
            )
        children[0].inc()
        children[1].observe(seconds)

    def saw_versions(self, versions: Any) -> None:
        """A completion was recorded whose output tokens had these policy versions (any sequence)."""
        if len(versions):
            self.served_version = int(versions[-1])
