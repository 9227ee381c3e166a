"""Added latency at 1 client, measured in rounds.

One cell per stack measures one process of it over one stretch of time, and on these shared 2-core
machines both move the p50 at 1 client. Two processes of the same proxy code, measured in alternation
for six rounds, differed by 0.06 ms in the median (json). The same stack, restarted for each of ten
rounds, spanned 0.3 ms (1.10 to 1.40 ms). The worker's own p50, which every added latency is taken
against, drifts as well. On Postgres the 1 ms target sits 0.1 to 0.3 ms above the floor of a recording
proxy, so a single cell decides it by luck.

So each round starts every server afresh: a new worker, measured directly, then each stack in front of it
(in an order rotated every round), then the worker again. A stack's added latency in a round is its p50
minus the mean of the worker's two p50s in that round, and the figure is the median over rounds; what a
stack adds beyond its floor is the median of their differences round by round, both measured in front of
the same worker minutes apart at most.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

S = TypeVar("S")
W = TypeVar("W")

MODES = (False, True)  # non-streaming, streaming


@dataclass(frozen=True)
class RoundCell:
    """One stack's p50 at 1 client in one round and mode, with the worker's own p50 of that round."""

    stack: str
    stream: bool
    round: int
    p50_ms: float
    baseline_ms: float
    errors: int = 0

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
    measure_stack: Callable[[S], dict[bool, tuple[float, int]]],
    baseline: str = "worker",
) -> Iterator[RoundCell]:
    """Run `rounds` rounds over the stacks `names`, yielding each round's cells as it ends.
    `measure_stack` warms a started stack up and gives its (p50 ms, errors) per mode at 1 client."""
    for index in range(rounds):
        with start_worker() as worker:
            with start(baseline, worker) as direct:
                before = measure_stack(direct)
            measured = {}
            for name in rotated(names, index):
                with start(name, worker) as started:
                    measured[name] = measure_stack(started)
            with start(baseline, worker) as direct:
                after = measure_stack(direct)
        for name in names:
            for stream in MODES:
                p50, errors = measured[name][stream]
                base = (before[stream][0] + after[stream][0]) / 2
                yield RoundCell(name, stream, index, p50, base, errors)


def _of(cells: Sequence[RoundCell], stack: str, stream: bool) -> dict[int, RoundCell]:
    return {c.round: c for c in cells if c.stack == stack and c.stream == stream}


def median_added(cells: Sequence[RoundCell], stack: str, stream: bool) -> float:
    """The median over rounds of `stack`'s added latency (NaN when it was not measured)."""
    values = [c.added_ms for c in _of(cells, stack, stream).values() if not math.isnan(c.p50_ms)]
    return statistics.median(values) if values else math.nan


def median_beyond(cells: Sequence[RoundCell], stack: str, floor: str, stream: bool) -> float:
    """The median over rounds of `stack`'s p50 minus `floor`'s in the same round."""
    ours, theirs = _of(cells, stack, stream), _of(cells, floor, stream)
    values = [ours[r].p50_ms - theirs[r].p50_ms for r in sorted(ours.keys() & theirs.keys())]
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def spread(cells: Sequence[RoundCell], stack: str, stream: bool) -> tuple[float, float]:
    """The least and greatest added latency of `stack` over the rounds."""
    values = [c.added_ms for c in _of(cells, stack, stream).values() if not math.isnan(c.p50_ms)]
    return (min(values), max(values)) if values else (math.nan, math.nan)


def rounds_markdown(cells: Sequence[RoundCell], floors: dict[str, str]) -> list[str]:
    """The rounds as table lines: per stack and mode, the median added latency, its range, and (where
    `floors` names the stack's floor) the median beyond that floor."""
    if not cells:
        return []
    rounds = len({cell.round for cell in cells})
    lines = [
        f"Latency rounds at 1 client: {rounds} round{'' if rounds == 1 else 's'}, every server started "
        "afresh in each.",
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
    return lines
