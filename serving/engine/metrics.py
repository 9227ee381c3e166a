"""The engine's Prometheus metrics, one registry per engine (no process-global collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    """Counters the decode thread updates and /metrics and /server_info read."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.running = Gauge("flywheel_engine_running_requests", "Sequences in the decode batch",
                             registry=self.registry)
        self.waiting = Gauge("flywheel_engine_waiting_requests", "Sequences waiting to be admitted",
                             registry=self.registry)
        self.max_batch_size = Gauge("flywheel_engine_max_batch_size_observed",
                                    "Largest number of sequences decoded in one step", registry=self.registry)
        self.decode_steps = Counter("flywheel_engine_decode_steps", "Decode steps run",
                                    registry=self.registry)
        self.prefills = Counter("flywheel_engine_prefills", "Prefill forwards run", registry=self.registry)
        self.generated_tokens = Counter("flywheel_engine_generated_tokens", "Output tokens sampled",
                                        registry=self.registry)
        self.finished = Counter("flywheel_engine_finished_requests", "Sequences finished, by reason",
                                ["reason"], registry=self.registry)
        self.batch_size = Histogram("flywheel_engine_decode_batch_size", "Sequences per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.weight_updates = Counter("flywheel_engine_weight_updates", "Weight updates, by outcome",
                                      ["outcome"], registry=self.registry)
        self.totals = {"running_requests": 0, "waiting_requests": 0, "max_batch_size_observed": 0,
                       "decode_steps": 0, "prefills": 0, "generated_tokens": 0}
        """Plain copies of the above for /server_info (written by the decode thread only)."""

    def observe_step(self, batch_size: int, new_tokens: int) -> None:
        self.decode_steps.inc()
        self.generated_tokens.inc(new_tokens)
        self.batch_size.observe(batch_size)
        self.totals["decode_steps"] += 1
        self.totals["generated_tokens"] += new_tokens
        if batch_size > self.totals["max_batch_size_observed"]:
            self.totals["max_batch_size_observed"] = batch_size
            self.max_batch_size.set(batch_size)

    def observe_prefill(self, rows: int) -> None:
        self.prefills.inc()
        self.generated_tokens.inc(rows)
        self.totals["prefills"] += 1
        self.totals["generated_tokens"] += rows

    def observe_queues(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.totals["running_requests"] = running
        self.totals["waiting_requests"] = waiting

    def snapshot(self) -> dict[str, int]:
        """A plain dict for /server_info's internal_states."""
        return dict(self.totals)
