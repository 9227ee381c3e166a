"""The trainer's Prometheus endpoint: what the Monitor is told (steps, claims, pushes, the served version)
moves the named series a scrape parses, a weight push that fails is counted and still raised, the endpoint
starts on `trainer.metrics_port` (0: a free one) and stops with the run, and a sink that raises is dropped
after one logged error while training and the other sinks go on."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import pytest

from flywheel.config import load_config
from flywheel.stack import Stack, describe, trainer_metrics_url
from tests.support.metrics_readers import scrape, total, value
from trainer.config import TrainerConfig
from trainer.metrics import TrainerMetrics, WatchedSync
from trainer.monitor import Monitor
from trainer.runner import open_monitor
from trainer.telemetry.base import MetricsSink

STEP = {"reward/mean": 0.75, "loss": -0.125, "grad_norm": 2.5, "kl/prox_theta": 1e-4, "kl/behave_theta": 2e-4,
        "entropy": 1.5, "staleness/mean": 0.5, "staleness/max": 1.0, "perf/tokens_per_s": 900.0,
        "batch/trajectories": 4.0, "tokens/trained": 48.0, "perf/step_s": 0.4, "advantage/std": 0.9}


class RecordingSink(MetricsSink):
    name = "recording"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


class BrokenSink(RecordingSink):
    name = "broken"

    def log_step(self, step: int, version: int, metrics: Mapping[str, float]) -> None:
        super().log_step(step, version, metrics)
        raise ConnectionError("tracking server unreachable")


class FlakyPush:
    def __init__(self) -> None:
        self.fail = False

    async def push(self, clients: Sequence[object], checkpoint_path: str, version: int) -> float:
        if self.fail:
            raise RuntimeError("worker refused the weights")
        return 0.3


@pytest.fixture
def served() -> TrainerMetrics:
    metrics = TrainerMetrics()
    metrics.serve("127.0.0.1", 0)
    yield metrics
    metrics.close()


async def test_the_monitor_moves_the_named_series(tmp_path: Path, served: TrainerMetrics) -> None:
    url = f"http://127.0.0.1:{served.port}/metrics"
    before = scrape(url)
    assert value(before, "flywheel_trainer_steps_total") == 0
    assert value(before, "flywheel_trainer_claims_total", result="empty") == 0
    monitor = Monitor(tmp_path / "metrics.jsonl", [served])
    sync = WatchedSync(FlakyPush(), monitor)
    monitor.served(0)
    monitor.claimed(0, 0)
    monitor.claimed(4, 2)
    monitor.record(1, 1, {**STEP, "loss": float("nan")})
    await sync.push([], "/ckpt/1", 1)
    monitor.claimed(4, 0)
    monitor.record(2, 2, STEP)
    await sync.push([], "/ckpt/2", 2)

    after = scrape(url)
    assert value(after, "flywheel_trainer_steps_total") == 2
    assert value(after, "flywheel_trainer_policy_version") == 2
    assert value(after, "flywheel_trainer_served_version") == 2
    assert value(after, "flywheel_trainer_reward_mean") == 0.75
    assert value(after, "flywheel_trainer_loss") == -0.125  # the NaN of step 1 never reached a gauge
    assert value(after, "flywheel_trainer_grad_norm") == 2.5
    assert value(after, "flywheel_trainer_entropy") == 1.5
    assert value(after, "flywheel_trainer_tokens_per_second") == 900
    assert value(after, "flywheel_trainer_kl", estimate="prox_theta") == 1e-4
    assert value(after, "flywheel_trainer_kl", estimate="behave_theta") == 2e-4
    assert value(after, "flywheel_trainer_staleness", stat="max") == 1
    assert value(after, "flywheel_trainer_step_metric", name="advantage/std") == 0.9
    assert value(after, "flywheel_trainer_samples_trained_total") == 8
    assert value(after, "flywheel_trainer_tokens_trained_total") == 96
    assert value(after, "flywheel_trainer_samples_dropped_stale_total") == 2
    assert value(after, "flywheel_trainer_claims_total", result="batch") == 2
    assert value(after, "flywheel_trainer_claims_total", result="empty") == 1
    assert value(after, "flywheel_trainer_step_seconds_count") == 2
    assert value(after, "flywheel_trainer_push_seconds_count") == 2
    assert value(after, "flywheel_trainer_push_seconds_sum") == pytest.approx(0.6)
    assert value(after, "flywheel_trainer_weight_push_failures_total") == 0
    assert value(after, "flywheel_trainer_last_step_timestamp_seconds") > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]  # the file is written as before


async def test_a_failed_push_is_counted_and_raised(served: TrainerMetrics) -> None:
    monitor = Monitor(None, [served])
    push = FlakyPush()
    sync = WatchedSync(push, monitor)
    await sync.push([], "/ckpt/1", 1)
    push.fail = True
    with pytest.raises(RuntimeError, match="refused"):
        await sync.push([], "/ckpt/2", 2)
    samples = scrape(f"http://127.0.0.1:{served.port}/metrics")
    assert value(samples, "flywheel_trainer_weight_push_failures_total") == 1
    assert value(samples, "flywheel_trainer_served_version") == 1  # still the version that got there
    assert total(samples, "flywheel_trainer_push_seconds_count") == 1


def test_metrics_port_0_serves_a_free_port_until_the_run_closes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = TrainerConfig(metrics_port=0, tensorboard=False)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        monitor = open_monitor(config, tmp_path, {"trainer": config.model_dump(mode="json")})
    metrics = monitor.sinks[0]
    assert isinstance(metrics, TrainerMetrics) and metrics.port
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    assert f"trainer metrics (Prometheus) at {url}" in caplog.text
    monitor.record(1, 1, STEP)
    assert value(scrape(url), "flywheel_trainer_steps_total") == 1
    monitor.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5)


def test_no_port_serves_nothing(tmp_path: Path) -> None:
    monitor = open_monitor(TrainerConfig(tensorboard=False), tmp_path, {})
    assert [type(sink) for sink in monitor.sinks] == [TrainerMetrics]
    assert monitor.sinks[0].port is None  # type: ignore[attr-defined]
    monitor.close()


def test_a_sink_that_raises_is_logged_once_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken, healthy = BrokenSink(), RecordingSink()
    monitor = Monitor(tmp_path / "metrics.jsonl", [broken, healthy])
    with caplog.at_level(logging.ERROR, logger="trainer.monitor"):
        for step in (1, 2, 3):
            assert monitor.record(step, step, {"reward/mean": 0.5}) == {"reward/mean": 0.5}
    failures = [r for r in caplog.records if "metrics sink failed" in r.getMessage()]
    assert len(failures) == 1 and "the broken metrics sink failed (log_step)" in failures[0].getMessage()
    assert broken.steps == [1] and healthy.steps == [1, 2, 3]
    assert monitor.sinks == [healthy]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    monitor.close()
    assert healthy.closed and not broken.closed and monitor.sinks == []


@pytest.mark.parametrize("configured", [None, 0, 9477])
def test_flywheel_up_gives_the_trainer_a_metrics_port_and_prints_it(
    tmp_path: Path, configured: int | None
) -> None:
    overrides = [] if configured is None else [f"trainer.metrics_port={configured}"]
    config = load_config(None, overrides)
    trainer_overrides = list(overrides)
    url = trainer_metrics_url(config, trainer_overrides)
    port = int(url.removeprefix("http://127.0.0.1:").removesuffix("/metrics"))
    if configured:
        assert port == configured and trainer_overrides == overrides  # the trainer already has it
    else:
        assert port > 0 and trainer_overrides[-1] == f"trainer.metrics_port={port}"  # the last override wins
    stack = Stack("http://127.0.0.1:8000", "fw-admin-x", metrics={"proxy": "http://127.0.0.1:8000/metrics",
                                                                  "trainer": url})
    text = describe(stack, tmp_path)
    assert f"metrics:    {url}   (trainer, Prometheus)" in text.splitlines()
    assert "metrics:    http://127.0.0.1:8000/metrics   (proxy, Prometheus)" in text.splitlines()
