"""Proxy overhead, before vs after: compares the rounds of two `proxy_overhead.py --json` runs (two
revisions measured one after the other on the same idle machine) cell by cell, the median of each and an
exact two-sided permutation test of the difference (Mann-Whitney U), since one process's figures move by
±15% from start to start and only a difference beyond that spread is a regression. Two runs one after
the other also see the machine drift between them: proxy_overhead_interleaved.py alternates the two
trees run by run instead, and normalises every figure by the worker's own in the same run.

    git worktree add /tmp/before REV && ln -s "$PWD/.venv" /tmp/before/.venv
    (cd /tmp/before && .venv/bin/python benchmarks/proxy_overhead.py --quick --only worker,flywheel-sqlite \\
        --rounds 8 --json /tmp/before.json)
    .venv/bin/python benchmarks/proxy_overhead.py --quick --only worker,flywheel-sqlite --rounds 8 \\
        --json /tmp/after.json
    .venv/bin/python benchmarks/proxy_overhead_ab.py /tmp/before.json /tmp/after.json \\
        --labels REV HEAD --json benchmarks/results/proxy_overhead_ab.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS = (("rate", "req/s"), ("added_ms", "p50 added ms"))


def u_statistic(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Mann-Whitney U of `xs` against `ys`: pairs where x is larger, ties counting a half."""
    return sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)


def permutation_p(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Exact two-sided p-value of U over every split of the pooled values (8 + 8 rounds: 12,870)."""
    pooled, n = [*xs, *ys], len(xs)
    centre = n * len(ys) / 2
    observed = abs(u_statistic(xs, ys) - centre)
    splits = extreme = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        picked = set(chosen)
        left = [pooled[i] for i in chosen]
        right = [v for i, v in enumerate(pooled) if i not in picked]
        splits += 1
        extreme += abs(u_statistic(left, right) - centre) >= observed - 1e-9
    return extreme / splits


def cells(run: dict[str, Any], metric: str) -> dict[tuple[str, bool, int], list[float]]:
    """A run's rounds by (stack, streaming, clients): the metric's value in each round."""
    found: dict[tuple[str, bool, int], list[float]] = {}
    for row in run["rounds"]:
        if row.get(metric) is not None:
            found.setdefault((row["stack"], row["stream"], row["clients"]), []).append(float(row[metric]))
    return found


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for metric, name in METRICS:
        old, new = cells(before, metric), cells(after, metric)
        for key in sorted(old.keys() & new.keys()):
            a, b = old[key], new[key]
            rows.append({
                "stack": key[0], "mode": "stream" if key[1] else "json", "clients": key[2], "metric": name,
                "before_median": statistics.median(a), "after_median": statistics.median(b),
                "change": statistics.median(b) / statistics.median(a) - 1, "p": permutation_p(a, b),
                "before": a, "after": b,
            })
    return rows


def table(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    lines = [f"| stack | mode | clients | metric | {labels[0]} median | {labels[1]} median | change | p |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        medians = f"{r['before_median']:.2f} | {r['after_median']:.2f}"
        lines.append(f"| {r['stack']} | {r['mode']} | {r['clients']} | {r['metric']} | {medians} "
                     f"| {r['change']:+.1%} | {r['p']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--labels", nargs=2, default=["before", "after"])
    parser.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = parser.parse_args()
    rows = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()))
    print(table(rows, args.labels))
    if args.json is not None:
        args.json.write_text(json.dumps({"labels": args.labels, "cells": rows}, indent=1) + "\n")
        print(f"(written to {args.json})")


if __name__ == "__main__":
    main()
