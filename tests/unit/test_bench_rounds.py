"""The proxy benchmark's latency rounds (benchmarks/overhead/rounds.py): every server started afresh each
round, stacks in a rotated order, each round's added latency against that round's own worker, medians
over rounds. (No timing: scripted p50s stand in for measurements.)"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from benchmarks.overhead.rounds import (
    Cell,
    RoundCell,
    latency_rounds,
    median_added,
    median_beyond,
    median_ratio,
    rotated,
    rounds_markdown,
    spread,
)


def test_rotation_gives_each_stack_every_place() -> None:
    names = ["a", "b", "c"]
    orders = [rotated(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotated(names, 4) == orders[1]
    assert rotated([], 2) == []


def test_each_round_starts_every_server_afresh_and_takes_its_own_baseline() -> None:
    events: list[str] = []
    workers = iter(range(100))
    # p50 (json, stream) per (stack, worker): worker 0 is slow, worker 1 fast; the stacks add the same.
    worker_p50 = {0: (1.0, 1.5), 1: (0.2, 0.3)}
    adds = {"floor": (0.5, 0.6), "ours": (0.7, 0.9)}

    @contextmanager
    def start_worker() -> Iterator[int]:
        worker = next(workers)
        events.append(f"worker {worker} up")
        yield worker
        events.append(f"worker {worker} down")

    @contextmanager
    def start(name: str, worker: int) -> Iterator[tuple[str, int]]:
        events.append(f"{name} up")
        yield name, worker
        events.append(f"{name} down")

    asked: list[tuple[str, tuple[int, ...]]] = []

    def measure_stack(started: tuple[str, int], clients: Sequence[int]) -> dict[tuple[bool, int], Cell]:
        name, worker = started
        asked.append((name, tuple(clients)))
        base = worker_p50[worker]
        extra = adds.get(name, (0.0, 0.0))
        rates = {"floor": 1000.0, "ours": 400.0 + 100 * worker}
        return {
            (stream, concurrency): Cell(base[stream] + extra[stream], rates.get(name, 0.0) * concurrency)
            for stream in (False, True) for concurrency in clients
        }

    cells = list(latency_rounds(["floor", "ours"], 2, start_worker, start, measure_stack, (1, 16)))

    assert events == [
        "worker 0 up", "worker up", "worker down", "floor up", "floor down", "ours up", "ours down",
        "worker up", "worker down", "worker 0 down",
        "worker 1 up", "worker up", "worker down", "ours up", "ours down", "floor up", "floor down",
        "worker up", "worker down", "worker 1 down",
    ]
    assert len(cells) == 16
    # The worker is measured at 1 client only; the stacks at every concurrency asked.
    assert asked[:4] == [("worker", (1,)), ("floor", (1, 16)), ("ours", (1, 16)), ("worker", (1,))]
    assert all(math.isnan(c.added_ms) for c in cells if c.clients == 16)
    # Requests/s as a share of another stack's: the median of each round's ratio (0.4 and 0.5).
    assert median_ratio(cells, "ours", "floor", True, 16) == pytest.approx(0.45)
    # Each round's added latency is taken against its own worker, so a slow round adds nothing.
    assert [round(c.added_ms, 6) for c in cells if c.stack == "ours" and not c.stream and c.clients == 1] == [
        0.7, 0.7
    ]
    assert median_added(cells, "ours", True) == pytest.approx(0.9)
    assert median_beyond(cells, "ours", "floor", False) == pytest.approx(0.2)


def _cell(stack: str, round_index: int, p50: float, baseline: float = 0.2) -> RoundCell:
    return RoundCell(stack, False, round_index, p50, baseline)


def test_medians_and_spread_over_rounds() -> None:
    cells = [
        _cell("ours", 0, 1.2), _cell("ours", 1, 1.0), _cell("ours", 2, 1.7),
        _cell("floor", 0, 1.0), _cell("floor", 1, 0.9), _cell("floor", 2, 1.2),
    ]
    assert median_added(cells, "ours", False) == pytest.approx(1.0)  # 1.0, 0.8, 1.5
    assert spread(cells, "ours", False) == pytest.approx((0.8, 1.5))
    # Beyond the floor round by round (0.2, 0.1, 0.5), not median minus median (0.2).
    assert median_beyond(cells, "ours", "floor", False) == pytest.approx(0.2)
    assert math.isnan(median_added(cells, "ours", True))  # never measured streaming
    assert math.isnan(median_beyond(cells, "ours", "absent", False))


def test_a_round_without_answers_is_left_out() -> None:
    cells = [_cell("ours", 0, math.nan), _cell("ours", 1, 1.0), _cell("ours", 2, 1.2)]
    assert median_added(cells, "ours", False) == pytest.approx(0.9)


def test_markdown_names_the_rounds_and_the_floor() -> None:
    cells = [_cell("passthrough-postgres", 0, 0.9), _cell("flywheel-postgres", 0, 1.0)]
    lines = rounds_markdown(cells, {"flywheel-postgres": "passthrough-postgres"})
    assert lines[0].startswith("Rounds: 1 round,")
    row = next(line for line in lines if line.startswith("| flywheel-postgres | json"))
    assert row.split("|")[3:7] == [" +0.80 ", " +0.80 ", " +0.80 ", " +0.10 "]
    assert rounds_markdown([], {}) == []


def test_markdown_gives_the_share_of_the_reference_at_more_clients() -> None:
    cells = [
        RoundCell("passthrough", False, 0, 2.0, math.nan, 0, 16, 1000.0),
        RoundCell("flywheel-postgres", False, 0, 5.0, math.nan, 0, 16, 400.0),
    ]
    lines = rounds_markdown(cells, {})
    assert "| flywheel-postgres | json | 400 | 40% |" in lines
    assert "| passthrough | json | 1,000 | — |" in lines
