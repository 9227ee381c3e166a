"""The monitor: one JSON line and one log line per step; non-finite values never reach storage."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from trainer.monitor import Monitor


def test_each_step_appends_a_json_line_and_logs_a_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monitor = Monitor(tmp_path / "run" / "metrics.jsonl")
    with caplog.at_level(logging.INFO, logger="trainer.monitor"):
        monitor.record(1, 1, {"reward/mean": 0.25, "reward/std": 0.5, "perf/push_s": 0.125})
        stored = monitor.record(2, 2, {"reward/mean": 0.5, "loss": math.nan, "grad_norm": math.inf})
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["reward/mean"] == 0.25 and lines[0]["policy_version"] == 1
    assert stored == {"reward/mean": 0.5} and "loss" not in lines[1]
    assert "step 1 → v1 | reward 0.250 ± 0.500 push 0.12s" in caplog.text
    assert "non-finite metrics left out: grad_norm=inf, loss=nan" in caplog.text
    assert len(monitor.history) == 2
