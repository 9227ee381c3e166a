"""Proxy overhead, before vs after, interleaved: `proxy_overhead.py --quick --only worker,flywheel-sqlite
--rounds 1` run alternately in two trees (two revisions' worktrees), pair after pair, and the runs merged
cell by cell.

Two revisions measured one after the other (proxy_overhead_ab.py) see two stretches of the machine's
time, and a machine drifts: in one such comparison the worker alone, which no change touched, lost
throughput between the runs. Interleaved, both revisions see the same drift. Each pair runs both trees
back to back, in the order A B, then B A in the next pair (so a steady drift weighs on both alike), and
every run starts its own servers.

Every figure is also reported normalised by the worker's own in the same run (the worker is the control:
the same code in both trees, so what moves it is the machine): a stack's requests/s over the worker's
requests/s at the same mode and concurrency, and the proxy's CPU per request over the worker's CPU per
request while it served that proxy. The cells (`metric`, mode, clients):

- `req/s`, `p50 added ms`: the run's round (every server started afresh; added latency at 1 client is
  already against that round's worker);
- `req/s / worker`: the round's requests/s over the worker's in the same run's sweep;
- `sweep req/s`, `sweep req/s / worker`: the sweep's cell, and over the worker's sweep cell (both served
  by the same worker process minutes apart);
- `CPU ms/req`, `CPU / worker CPU`: the proxy's CPU per request in the sweep (robust to other load), and
  over the worker's CPU per request in the same cell;
- `worker req/s`: the control itself (the two trees' worker code should not differ; a gap here is drift
  or noise, and bounds what the other cells can tell).

For each cell: both medians, the change, an exact two-sided permutation p over the unpaired values
(proxy_overhead_ab.py), and, for the pairs, the median of the pairs' ratios B/A with an exact sign-flip p
of their log ratios (each pair shares its stretch of time, so this one sees past drift).

    git worktree add /tmp/before REV && ln -s "$PWD/.venv" /tmp/before/.venv
    .venv/bin/python benchmarks/proxy_overhead_interleaved.py /tmp/before . --pairs 8 \\
        --labels REV HEAD --out /tmp/interleaved --json benchmarks/results/proxy_overhead_interleaved.json
    # the same analysis again from the runs kept in --out (or with runs added by another invocation):
    .venv/bin/python benchmarks/proxy_overhead_interleaved.py --analyse /tmp/interleaved --labels REV HEAD
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.proxy_overhead_ab import permutation_p

STACK = "flywheel-sqlite"
CONTROL = "worker"
BENCH_ARGS = ("--quick", "--only", f"{CONTROL},{STACK}", "--rounds", "1")
SIDES = ("a", "b")
_EXACT_SIGN_FLIPS = 16  # up to 2**16 sign assignments exactly; more pairs are sampled
_EXACT_SPLITS = 50_000  # unpaired permutation test exactly up to this many splits, else not at all

Cell = tuple[str, str, int]
"""(metric, mode, clients)."""


def _mode(stream: bool) -> str:
    return "stream" if stream else "json"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def run_cells(run: dict[str, Any], stack: str = STACK, control: str = CONTROL) -> dict[Cell, float]:
    """One `proxy_overhead.py --json` run's figures by cell (see the module docstring)."""
    rows = {(r["stack"], r["stream"], r["clients"]): r for r in run.get("rows", [])}
    out: dict[Cell, float] = {}

    def put(metric: str, stream: bool, clients: int, value: float | None) -> None:
        if value is not None and not math.isnan(value):
            out[metric, _mode(stream), clients] = float(value)

    for (name, stream, clients), row in rows.items():
        if name == control:
            put("worker req/s", stream, clients, row["rate"])
        elif name == stack:
            put("sweep req/s", stream, clients, row["rate"])
            put("CPU ms/req", stream, clients, row["cpu_ms"])
            put("CPU / worker CPU", stream, clients, _ratio(row["cpu_ms"], row.get("worker_cpu_ms")))
            worker = rows.get((control, stream, clients))
            if worker is not None:
                put("sweep req/s / worker", stream, clients, _ratio(row["rate"], worker["rate"]))
    for cell in run.get("rounds", []):
        if cell["stack"] != stack:
            continue
        stream, clients = cell["stream"], cell["clients"]
        put("req/s", stream, clients, cell.get("rate"))
        if clients == 1:
            put("p50 added ms", stream, clients, cell.get("added_ms"))
        worker = rows.get((control, stream, clients))
        if worker is not None:
            put("req/s / worker", stream, clients, _ratio(cell.get("rate"), worker["rate"]))
    return out


def sign_flip_p(logs: Sequence[float], seed: int = 0) -> float:
    """Two-sided p of the mean of paired log ratios against 0: the share of sign assignments whose
    |sum| is at least the observed (exact up to 2**16 pairs' assignments, else 100,000 sampled)."""
    if not logs:
        return math.nan
    observed = abs(sum(logs)) - 1e-12
    if len(logs) <= _EXACT_SIGN_FLIPS:
        signs = itertools.product((1, -1), repeat=len(logs))
        totals = [abs(sum(s * x for s, x in zip(sign, logs, strict=True))) for sign in signs]
    else:
        rng = random.Random(seed)
        totals = [abs(sum(x if rng.random() < 0.5 else -x for x in logs)) for _ in range(100_000)]
    return sum(total >= observed for total in totals) / len(totals)


def _unpaired_p(a: Sequence[float], b: Sequence[float]) -> float:
    if not a or not b or math.comb(len(a) + len(b), len(a)) > _EXACT_SPLITS:
        return math.nan
    return permutation_p(a, b)


@dataclass(frozen=True)
class Pair:
    """One pair of runs, back to back: each tree's cells."""

    a: dict[Cell, float]
    b: dict[Cell, float]


def compare(pairs: Sequence[Pair]) -> list[dict[str, Any]]:
    """Every cell both trees measured: medians, change, unpaired p, and the pairs' median ratio and
    sign-flip p."""
    cells = sorted({cell for pair in pairs for cell in pair.a.keys() & pair.b.keys()},
                   key=lambda c: (c[0], c[1], c[2]))
    rows = []
    for cell in cells:
        a = [pair.a[cell] for pair in pairs if cell in pair.a]
        b = [pair.b[cell] for pair in pairs if cell in pair.b]
        both = [(pair.a[cell], pair.b[cell]) for pair in pairs if cell in pair.a and cell in pair.b]
        ratios = [y / x for x, y in both if x > 0 and y > 0]
        metric, mode, clients = cell
        rows.append({
            "metric": metric, "mode": mode, "clients": clients,
            "a_median": statistics.median(a), "b_median": statistics.median(b),
            "change": statistics.median(b) / statistics.median(a) - 1 if statistics.median(a) else math.nan,
            "p": _unpaired_p(a, b),
            "pair_ratio": statistics.median(ratios) if ratios else math.nan,
            "pair_p": sign_flip_p([math.log(r) for r in ratios]),
            "pairs": len(both), "a": a, "b": b,
        })
    return rows


def _fmt(value: float, spec: str) -> str:
    return "—" if math.isnan(value) else format(value, spec)


def table(rows: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    lines = [f"| metric | mode | clients | {labels[0]} median | {labels[1]} median | change | p "
             f"| pairs' median ratio | paired p | pairs |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['metric']} | {r['mode']} | {r['clients']} | {r['a_median']:.3f} | {r['b_median']:.3f} "
            f"| {_fmt(r['change'], '+.1%')} | {_fmt(r['p'], '.2f')} | {_fmt(r['pair_ratio'] - 1, '+.1%')} "
            f"| {_fmt(r['pair_p'], '.3f')} | {r['pairs']} |"
        )
    return "\n".join(lines)


def run_path(out: Path, side: str, index: int) -> Path:
    return out / f"{side}-{index:03d}.json"


def load_pairs(out: Path) -> list[Pair]:
    """The complete pairs kept in `out` (a run that failed or is missing leaves its pair out)."""
    pairs = []
    for index in sorted({int(p.stem.split("-")[1]) for p in out.glob("[ab]-*.json")}):
        paths = [run_path(out, side, index) for side in SIDES]
        if all(path.exists() for path in paths):
            a, b = (run_cells(json.loads(path.read_text())) for path in paths)
            pairs.append(Pair(a, b))
    return pairs


def bench_command(tree: Path, json_out: Path, extra: Sequence[str]) -> list[str]:
    """One run of the benchmark in `tree`, with that tree's own venv and benchmark code."""
    python = tree / ".venv" / "bin" / "python"
    return [str(python), "benchmarks/proxy_overhead.py", *BENCH_ARGS, *extra, "--json", str(json_out)]


def run_pairs(trees: Sequence[Path], out: Path, pairs: int, extra: Sequence[str], start: int = 0) -> None:
    """`pairs` pairs of runs, A then B, then B then A, each run's JSON kept in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest["trees"] = [str(tree) for tree in trees]
    order = manifest.setdefault("a_first", {})
    for index in range(start, start + pairs):
        a_first = index % 2 == 0
        order[str(index)] = a_first
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        for side in (SIDES if a_first else SIDES[::-1]):
            tree = trees[SIDES.index(side)]
            target = run_path(out, side, index)
            print(f"pair {index} {side}: {tree}", flush=True)
            log = out / f"{side}-{index:03d}.log"
            with log.open("w") as sink:
                done = subprocess.run(bench_command(tree, target.resolve(), extra), cwd=tree, stdout=sink,
                                      stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                print(f"  failed ({done.returncode}); see {log}", flush=True)
                target.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path, help="tree A (before) and tree B (after)")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="where each run's JSON is kept")
    parser.add_argument("--analyse", type=Path, default=None, help="only merge the runs kept here")
    parser.add_argument("--labels", nargs=2, default=["before", "after"])
    parser.add_argument("--bench-args", default="", help="more proxy_overhead.py options, one string")
    parser.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    args = parser.parse_args()
    if args.analyse is not None:
        out = args.analyse
    else:
        if len(args.trees) != 2:
            parser.error("give two trees (before, after), or --analyse DIR")
        if args.out is None:
            parser.error("--out DIR keeps the runs")
        out = args.out
        existing = [int(p.stem.split("-")[1]) for p in out.glob("[ab]-*.json")] if out.exists() else []
        run_pairs([tree.resolve() for tree in args.trees], out, args.pairs, shlex.split(args.bench_args),
                  start=max(existing, default=-1) + 1)
    pairs = load_pairs(out)
    if not pairs:
        sys.exit(f"no complete pair of runs in {out}")
    rows = compare(pairs)
    print(f"{len(pairs)} pairs ({args.labels[0]} = A, {args.labels[1]} = B)")
    print(table(rows, args.labels))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"labels": args.labels, "pairs": len(pairs), "cells": rows},
                                        indent=1) + "\n")
        print(f"(written to {args.json})")


if __name__ == "__main__":
    main()
