"""Proxy overhead: p50/p99 added latency and requests/s at 1, 16 and 64 concurrent clients, streaming and
not, for (a) a zero-latency scripted worker called directly (its OpenAI route, the baseline, and its SGLang
`/generate`), (b) a bare aiohttp passthrough (the floor any Python proxy pays), (c) Flywheel's proxy with
recording on, on SQLite and on a scratch Postgres database, and (d) LiteLLM's proxy, each proxy in front of
the same worker.

    .venv/bin/python benchmarks/proxy_overhead.py [--quick] [--only flywheel-sqlite,passthrough,...]
        [--seconds 5] [--clients 1,16,64] [--max-tokens 8] [--rounds 5] [--round-seconds 3]
        [--round-clients 1,16] [--json out.json]

Every server runs in its own process, started and stopped here (ports freed, the Postgres database
dropped); Flywheel is started as `flywheel proxy` runs it (uvicorn, migrated database, session keys from
the RL API, one session per client). The load generator (closed-loop aiohttp clients) runs in this
process. Added latency = the stack's percentile minus the worker's own at the same concurrency and mode.
Every Flywheel answer is checked to be a recorded completion. Targets: p50 added <= 1 ms at 1
client; at 16 clients >= 10x LiteLLM's and >= 30% of the passthrough's requests/s.

After the sweep, the rounds (benchmarks/overhead/rounds.py) measure every proxy but LiteLLM again at 1 and
16 clients, each round with every server started afresh; the 1-client target and the share of the
passthrough's requests/s are judged on their medians (LiteLLM's, far off, on the sweep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import stacks
from benchmarks.overhead.load import Measurement, Target, chat_target, generate_target, measure
from benchmarks.overhead.report import BASELINE, Row, Run, add_baselines, markdown, verdicts
from benchmarks.overhead.rounds import MODES, Cell, latency_rounds
from benchmarks.overhead.stacks import Server

STACKS = (
    "worker", "worker-generate", "passthrough", "passthrough-sqlite", "passthrough-postgres",
    "flywheel-sqlite", "flywheel-postgres",
    "litellm",
)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _sweep(run: Run, name: str, server: Server, worker: Server, target: Callable[[bool], Target]) -> int:
    """Measure `name` at every concurrency, non-streaming then streaming; the successful requests."""
    total = 0
    for stream in (False, True):
        # A fresh server's first calls pay one-off costs (template compilation, SQL statement caches,
        # pools filling); spend them before any cell, so its CPU per request is the steady state.
        total += measure(target(stream), 4, 0.0, run.args.warmup * 2, stream).total_ok
    for stream in (False, True):
        for clients in run.args.clients:
            cpu_before = server.cpu_seconds(), worker.cpu_seconds()
            result: Measurement = measure(target(stream), clients, run.args.seconds, run.args.warmup, stream)
            served = max(result.total_ok, 1)
            cpu_ms = [
                (after - before) * 1000 / served
                for before, after in zip(
                    cpu_before, (server.cpu_seconds(), worker.cpu_seconds()), strict=True
                )
            ]
            total += result.total_ok
            row = Row(
                name,
                stream,
                clients,
                result.rate,
                result.percentile(50),
                result.percentile(99),
                result.ok,
                result.errors,
                result.first_error,
                cpu_ms[0],
                cpu_ms[1],
            )
            run.rows.append(row)
            print(
                f"  {name:<18} stream={stream!s:<5} clients={clients:<3} {row.rate:8.0f} req/s  "
                f"p50 {row.p50_ms:7.2f} ms  p99 {row.p99_ms:7.2f} ms  cpu {row.cpu_ms:.2f} ms/req  "
                f"errors {row.errors}",
                flush=True,
            )
    return total


@dataclass
class Started:
    """A stack started for measuring: its server, what its clients send, and the answers it gave
    (counted against its recorded rows when it stops)."""

    server: Server
    target: Callable[[bool], Target]
    answered: int = 0


@contextmanager
def _started(run: Run, name: str, worker: Server, logs: Path) -> Iterator[Started]:
    """`name` started in front of `worker` (the worker stacks are `worker` itself); stopped on exit, and
    a recording stack's answers and rows then added to `run.recorded`."""
    args = run.args

    def chat(server: Server, model: str = stacks.BENCH_MODEL) -> Callable[[bool], Target]:
        return lambda stream: chat_target(server.url, model, args.max_tokens, stream, server.keys)

    def counted(started: Started, rows: Callable[[], int]) -> None:
        totals = run.recorded.setdefault(name, {"answered": 0, "recorded": 0})
        totals["answered"] += started.answered
        totals["recorded"] += rows()

    if name == "worker":
        yield Started(worker, chat(worker))
    elif name == "worker-generate":
        yield Started(worker, lambda s: generate_target(worker.url, args.max_tokens, s))
    elif name == "passthrough":
        with stacks.passthrough(logs, worker.url) as server:
            yield Started(server, chat(server))
    elif name == "passthrough-sqlite":  # a reference floor for a recording proxy, with no target
        with tempfile.TemporaryDirectory(prefix="passthrough-sqlite-") as scratch:
            with stacks.passthrough(logs, worker.url, f"{scratch}/calls.db") as server:
                started = Started(server, chat(server))
                yield started
            counted(started, lambda: _count_calls(f"{scratch}/calls.db"))
    elif name == "passthrough-postgres":  # the same floor on Postgres
        with stacks.postgres_database() as db_url:
            plain_url = db_url.replace("postgresql+asyncpg://", "postgresql://", 1)
            with stacks.passthrough(logs, worker.url, postgres_url=plain_url) as server:
                started = Started(server, chat(server))
                yield started
            counted(started, lambda: stacks.count_rows(plain_url, "calls"))
    elif name == "litellm":
        with stacks.litellm_proxy(logs, worker.url) as server:
            yield Started(server, chat(server))
    else:
        database: Callable[[], AbstractContextManager[str]] = (
            stacks.sqlite_database if name == "flywheel-sqlite" else stacks.postgres_database
        )
        with database() as db_url:
            sessions = max(args.clients)
            with stacks.flywheel_proxy(logs, db_url, worker.url, sessions, args.model) as server:
                started = Started(server, chat(server, args.model))
                yield started
            # Counted after the proxy stopped (a stream's record may still be in flight as it answers).
            counted(started, lambda: stacks.count_completions(db_url))


def _stack(run: Run, name: str, worker: Server, logs: Path) -> None:
    run.load.append(f"before {name}: {_uptime()}")
    with _started(run, name, worker, logs) as started:
        started.answered += _sweep(run, name, started.server, worker, started.target)


def _count_calls(path: str) -> int:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        return int(connection.execute("SELECT count(*) FROM calls").fetchone()[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 s per cell, 1 and 16 clients")
    parser.add_argument(
        "--only", default=",".join(STACKS), help=f"comma-separated stacks of: {', '.join(STACKS)}"
    )
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per cell (default 5)")
    parser.add_argument(
        "--warmup", type=float, default=None, help="untimed seconds before each cell (default 1)"
    )
    parser.add_argument("--clients", default=None, help="concurrency levels (default 1,16,64)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default="tiny", help="whose tokenizer and chat template Flywheel uses")
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="rounds at 1 and 16 clients, every server started afresh each round (default 5; 0: none)",
    )
    parser.add_argument(
        "--round-seconds", type=float, default=None,
        help="measured seconds per round, mode and concurrency (default 3)",
    )
    parser.add_argument(
        "--round-clients", default="1,16", help="concurrency levels the rounds measure (default 1,16)"
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/proxy_overhead.json"))
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    args.round_seconds = args.round_seconds if args.round_seconds is not None else (
        1.5 if args.quick else 3.0
    )
    args.seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    args.clients = [int(c) for c in (args.clients or ("1,16" if args.quick else "1,16,64")).split(",")]
    args.round_clients = sorted({1, *(int(c) for c in args.round_clients.split(","))})
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(STACKS))
    if unknown:
        parser.error(f"unknown stack(s) {', '.join(unknown)}; choose from {', '.join(STACKS)}")
    # The baseline first, so every other row has its added latency.
    args.only = [name for name in STACKS if name in args.only]
    return args


@contextmanager
def _logs() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="proxy-overhead-") as scratch:
        yield Path(scratch)


def _rounds(run: Run, logs: Path) -> None:
    """The rounds (benchmarks/overhead/rounds.py) over the proxies measured, LiteLLM aside (it is far
    from every target, so no close call, and it takes the longest to start)."""
    args = run.args
    names = [name for name in args.only if name not in (BASELINE, "worker-generate", "litellm")]
    if not args.rounds or not names:
        return

    def measure_stack(started: Started, clients: Sequence[int]) -> dict[tuple[bool, int], Cell]:
        for stream in MODES:  # a fresh server's one-off costs, as in the sweep
            started.answered += measure(started.target(stream), 1, 0.0, args.warmup, stream).total_ok
        out = {}
        for stream in MODES:
            for concurrency in clients:
                result = measure(
                    started.target(stream), concurrency, args.round_seconds, args.warmup / 2, stream
                )
                started.answered += result.total_ok
                out[stream, concurrency] = Cell(result.percentile(50), result.rate, result.errors)
        return out

    print(f"rounds ({args.rounds}, at {', '.join(map(str, args.round_clients))} clients):", flush=True)
    run.load.append(f"before the rounds: {_uptime()}")
    cells = latency_rounds(
        names, args.rounds, lambda: stacks.worker(logs),
        lambda name, worker: _started(run, name, worker, logs), measure_stack, args.round_clients,
    )
    for cell in cells:
        run.rounds.append(cell)
        print(
            f"  round {cell.round} {cell.stack:<20} stream={cell.stream!s:<5} clients={cell.clients:<3} "
            f"{cell.rate:8.0f} req/s  p50 {cell.p50_ms:6.3f} ms  "
            f"{'' if math.isnan(cell.added_ms) else f'added {cell.added_ms:+.3f} ms  '}errors {cell.errors}",
            flush=True,
        )


def _json_safe(record: dict[str, object]) -> dict[str, object]:
    """`record` with NaN (not measured) as null: JSON has no NaN, and strict readers refuse it."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in record.items()}


def main(argv: list[str] | None = None) -> None:
    run = Run(parse_args(argv))
    run.load.append(f"start: {_uptime()}")
    with _logs() as logs:
        try:
            with stacks.worker(logs) as worker:
                for name in run.args.only:
                    print(f"{name}:", flush=True)
                    _stack(run, name, worker, logs)
            _rounds(run, logs)
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    run.load.append(f"end: {_uptime()}")
    add_baselines(run)
    table = markdown(run)
    print()
    print(table)
    args = run.args
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {
                    "seconds": args.seconds,
                    "warmup": args.warmup,
                    "clients": args.clients,
                    "max_tokens": args.max_tokens,
                    "model": args.model,
                    "stacks": args.only,
                    "cpus": os.cpu_count(),
                    "rounds": args.rounds,
                    "round_seconds": args.round_seconds,
                    "round_clients": args.round_clients,
                },
                "rows": [_json_safe(vars(r)) for r in run.rows],
                "rounds": [_json_safe({**vars(cell), "added_ms": cell.added_ms}) for cell in run.rounds],
                "targets": verdicts(run),
                "recorded": run.recorded,
                "load": run.load,
                "markdown": table,
            },
            indent=2,
        )
    )
    print(f"\n(written to {args.json})")


if __name__ == "__main__":
    main()
