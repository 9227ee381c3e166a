"""Added latency at 1 client (and requests/s at more), measured in rounds.

One cell per stack measures one process of it over one stretch of time, and on a shared machine both
move the p50 at 1 client: two processes of the same proxy code differ, the same stack restarted lands
somewhere else each time, and the worker's own p50, which every added latency is taken against, drifts
as well. Where a target sits close to the floor of a recording proxy (the 1 ms target on Postgres), a
single cell decides it by luck.

So each round starts every server afresh: a new worker, measured directly, then each stack in front of it
(in an order rotated every round), then the worker again. A stack's added latency in a round is its p50
minus the mean of the worker's two p50s in that round, and the figure is the median over rounds; what a
stack adds beyond its floor is the median of their differences round by round, both measured in front of
the same worker minutes apart at most.

A process's luck moves its throughput as well (the same proxy, restarted, does markedly more or fewer
requests/s at 16 clients), so the rounds also measure each stack at more clients when asked; a stack's
share of another's requests/s is then the median of the rounds' ratios.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

S = TypeVar("S")
W = TypeVar("W")

MODES = (False, True)  # non-streaming, streaming


@dataclass(frozen=True)
class Cell:
    """What one measurement of a started stack gave."""

    p50_ms: float
    rate: float
    errors: int = 0


@dataclass(frozen=True)
class RoundCell:
    """One stack's p50 and requests/s in one round, mode and concurrency; at 1 client with the worker's
    own p50 of that round (the baseline of its added latency; NaN at other concurrencies)."""

    stack: str
    stream: bool
    round: int
    p50_ms: float
    baseline_ms: float
    errors: int = 0
    clients: int = 1
    rate: float = math.nan

    @property
    def added_ms(self) -> float:
        return self.p50_ms - self.baseline_ms


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """`names` started at position `round_index` (mod their count): each stack takes every place in turn."""
    if not names:
        return []
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def latency_rounds(
    names: Sequence[str],
    rounds: int,
    start_worker: Callable[[], AbstractContextManager[W]],
    start: Callable[[str, W], AbstractContextManager[S]],
    measure_stack: Callable[[S, Sequence[int]], dict[tuple[bool, int], Cell]],
    clients: Sequence[int] = (1,),
    baseline: str = "worker",
) -> Iterator[RoundCell]:
    """Run `rounds` rounds over the stacks `names`, yielding each round's cells as it ends.
    `measure_stack(started, clients)` warms a started stack up and measures it per mode and concurrency
    (the baseline at 1 client only)."""
    for index in range(rounds):
        with start_worker() as worker:
            with start(baseline, worker) as direct:
                before = measure_stack(direct, (1,))
            measured = {}
            for name in rotated(names, index):
                with start(name, worker) as started:
                    measured[name] = measure_stack(started, clients)
            with start(baseline, worker) as direct:
                after = measure_stack(direct, (1,))
        for name in names:
            for stream in MODES:
                base = (before[stream, 1].p50_ms + after[stream, 1].p50_ms) / 2
                for concurrency in clients:
                    cell = measured[name][stream, concurrency]
                    yield RoundCell(
                        name, stream, index, cell.p50_ms, base if concurrency == 1 else math.nan,
                        cell.errors, concurrency, cell.rate,
                    )


def _of(cells: Sequence[RoundCell], stack: str, stream: bool, clients: int = 1) -> dict[int, RoundCell]:
    return {c.round: c for c in cells if c.stack == stack and c.stream == stream and c.clients == clients}


def _measured(values: Iterable[float]) -> list[float]:
    return [value for value in values if not math.isnan(value)]


def _median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN (NaN if none is)."""
    kept = _measured(values)
    return statistics.median(kept) if kept else math.nan


def _paired(
    cells: Sequence[RoundCell], stack: str, other: str, stream: bool, clients: int = 1
) -> list[tuple[RoundCell, RoundCell]]:
    """`stack`'s and `other`'s cells of each round both were measured in."""
    ours, theirs = _of(cells, stack, stream, clients), _of(cells, other, stream, clients)
    return [(ours[r], theirs[r]) for r in sorted(ours.keys() & theirs.keys())]


def rounds_label(cells: Sequence[RoundCell]) -> str:
    """"median of N rounds": where a figure taken from `cells` comes from."""
    rounds = len({cell.round for cell in cells})
    return f"median of {rounds} round{'' if rounds == 1 else 's'}"


def median_ratio(cells: Sequence[RoundCell], stack: str, reference: str, stream: bool, clients: int) -> float:
    """The median over rounds of `stack`'s requests/s over `reference`'s in the same round."""
    pairs = _paired(cells, stack, reference, stream, clients)
    return _median(ours.rate / theirs.rate for ours, theirs in pairs if theirs.rate)


def median_rate(cells: Sequence[RoundCell], stack: str, stream: bool, clients: int) -> float:
    return _median(c.rate for c in _of(cells, stack, stream, clients).values())


def median_added(cells: Sequence[RoundCell], stack: str, stream: bool) -> float:
    """The median over rounds of `stack`'s added latency (NaN when it was not measured)."""
    return _median(c.added_ms for c in _of(cells, stack, stream).values())


def median_beyond(cells: Sequence[RoundCell], stack: str, floor: str, stream: bool) -> float:
    """The median over rounds of `stack`'s p50 minus `floor`'s in the same round."""
    return _median(ours.p50_ms - theirs.p50_ms for ours, theirs in _paired(cells, stack, floor, stream))


def spread(cells: Sequence[RoundCell], stack: str, stream: bool) -> tuple[float, float]:
    """The least and greatest added latency of `stack` over the rounds."""
    values = _measured(c.added_ms for c in _of(cells, stack, stream).values())
    return (min(values), max(values)) if values else (math.nan, math.nan)


def rounds_markdown(
    cells: Sequence[RoundCell], floors: dict[str, str], reference: str = "passthrough"
) -> list[str]:
    """The rounds as table lines: per stack and mode, the median added latency at 1 client, its range,
    and (where `floors` names the stack's floor) the median beyond that floor; at more clients, the
    median requests/s and the median of its ratio to `reference`'s in the same round."""
    if not cells:
        return []
    lines = [
        f"Rounds: {rounds_label(cells).removeprefix('median of ')}, every server started afresh in each.",
        "",
        "| stack | mode | p50 added ms, median | min | max | beyond its floor ms, median |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    stacks = list(dict.fromkeys(cell.stack for cell in cells))
    for stack in stacks:
        for stream in MODES:
            low, high = spread(cells, stack, stream)
            floor = floors.get(stack)
            beyond = median_beyond(cells, stack, floor, stream) if floor in stacks else math.nan
            lines.append(
                f"| {stack} | {'stream' if stream else 'json'} | {median_added(cells, stack, stream):+.2f} | "
                f"{low:+.2f} | {high:+.2f} | {'—' if math.isnan(beyond) else f'{beyond:+.2f}'} |"
            )
    many = sorted({cell.clients for cell in cells if cell.clients > 1})
    for clients in many:
        lines += [
            "",
            f"| stack | mode | req/s @{clients}, median | of {reference}'s, median of the rounds' ratios |",
            "| --- | --- | ---: | ---: |",
        ]
        for stack in stacks:
            for stream in MODES:
                ratio = median_ratio(cells, stack, reference, stream, clients)
                lines.append(
                    f"| {stack} | {'stream' if stream else 'json'} | "
                    f"{median_rate(cells, stack, stream, clients):,.0f} | "
                    f"{'—' if math.isnan(ratio) or stack == reference else f'{ratio:.0%}'} |"
                )
    return lines
