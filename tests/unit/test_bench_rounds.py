"""The proxy benchmark's latency rounds (benchmarks/overhead/rounds.py): every server started afresh each
round, stacks in a rotated order, each round's added latency against that round's own worker, medians
over rounds. (No timing: scripted p50s stand in for measurements.)"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from benchmarks.overhead.rounds import (
    RoundCell,
    latency_rounds,
    median_added,
    median_beyond,
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

    def measure_stack(started: tuple[str, int]) -> dict[bool, tuple[float, int]]:
        name, worker = started
        base = worker_p50[worker]
        extra = adds.get(name, (0.0, 0.0))
        return {stream: (base[stream] + extra[stream], 0) for stream in (False, True)}

    cells = list(latency_rounds(["floor", "ours"], 2, start_worker, start, measure_stack))

    assert events == [
        "worker 0 up", "worker up", "worker down", "floor up", "floor down", "ours up", "ours down",
        "worker up", "worker down", "worker 0 down",
        "worker 1 up", "worker up", "worker down", "ours up", "ours down", "floor up", "floor down",
        "worker up", "worker down", "worker 1 down",
    ]
    assert len(cells) == 8
    # Each round's added latency is taken against its own worker, so a slow round adds nothing.
    assert [round(c.added_ms, 6) for c in cells if c.stack == "ours" and not c.stream] == [0.7, 0.7]
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
    assert lines[0].startswith("Latency rounds at 1 client: 1 round,")
    row = next(line for line in lines if line.startswith("| flywheel-postgres | json"))
    assert row.split("|")[3:7] == [" +0.80 ", " +0.80 ", " +0.80 ", " +0.10 "]
    assert rounds_markdown([], {}) == []
