"""The interleaved before/after comparison (benchmarks/proxy_overhead_interleaved.py): each run's cells,
normalised by the worker's own figure in the same run, and paired across the runs of one pair. (No
timing: scripted runs stand in for measurements.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.proxy_overhead_interleaved import Pair, compare, load_pairs, run_cells, sign_flip_p


def _run(worker_rate: float, proxy_rate: float, cpu_ms: float = 1.0, added_ms: float = 0.5) -> dict[str, Any]:
    """A `proxy_overhead.py --json` run at 16 clients (and 1), streaming only."""
    rows = [
        {"stack": "worker", "stream": True, "clients": 16, "rate": worker_rate, "cpu_ms": 0.2,
         "worker_cpu_ms": 0.2},
        {"stack": "flywheel-sqlite", "stream": True, "clients": 16, "rate": proxy_rate * 1.1,
         "cpu_ms": cpu_ms, "worker_cpu_ms": cpu_ms / 4},
    ]
    rounds = [
        {"stack": "flywheel-sqlite", "stream": True, "clients": 16, "rate": proxy_rate, "added_ms": None},
        {"stack": "flywheel-sqlite", "stream": True, "clients": 1, "rate": 500.0, "added_ms": added_ms},
    ]
    return {"rows": rows, "rounds": rounds}


def test_a_runs_cells_are_normalised_by_its_own_worker() -> None:
    cells = run_cells(_run(worker_rate=2000.0, proxy_rate=800.0, cpu_ms=1.2))
    assert cells["req/s", "stream", 16] == 800.0
    assert cells["req/s / worker", "stream", 16] == pytest.approx(0.4)
    assert cells["sweep req/s / worker", "stream", 16] == pytest.approx(0.44)
    assert cells["CPU ms/req", "stream", 16] == 1.2
    assert cells["CPU / worker CPU", "stream", 16] == pytest.approx(4.0)
    assert cells["worker req/s", "stream", 16] == 2000.0
    assert cells["p50 added ms", "stream", 1] == 0.5
    assert ("p50 added ms", "stream", 16) not in cells  # a round's added latency is taken at 1 client


def test_drift_that_moves_the_worker_too_is_normalised_away() -> None:
    # The machine slows down pair by pair; B's proxy is as fast as A's relative to the worker, run by run.
    pairs = [Pair(run_cells(_run(2000.0 - 100 * i, 800.0 - 40 * i)),
                  run_cells(_run(1900.0 - 100 * i, 760.0 - 40 * i))) for i in range(6)]
    rows = {(r["metric"], r["mode"], r["clients"]): r for r in compare(pairs)}
    raw, normalised = rows["req/s", "stream", 16], rows["req/s / worker", "stream", 16]
    assert raw["change"] < -0.04 and raw["pair_p"] < 0.05  # raw: B looks slower in every pair
    assert normalised["pair_ratio"] == pytest.approx(1.0) and normalised["pair_p"] == 1.0
    assert raw["pairs"] == 6


def test_sign_flips_are_exact_for_few_pairs() -> None:
    assert sign_flip_p([0.1, 0.2, 0.3]) == pytest.approx(2 / 8)  # all one way: 2 of 8 assignments
    assert sign_flip_p([0.1, -0.1]) == 1.0
    assert math.isnan(sign_flip_p([]))


def test_only_complete_pairs_are_merged(tmp_path: Path) -> None:
    for name, run in [("a-000", _run(2000.0, 800.0)), ("b-000", _run(2000.0, 900.0)),
                      ("a-001", _run(2000.0, 800.0))]:  # pair 1's B run failed
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    pairs = load_pairs(tmp_path)
    assert len(pairs) == 1 and pairs[0].b["req/s", "stream", 16] == 900.0
