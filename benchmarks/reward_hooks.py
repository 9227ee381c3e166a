"""How fast the built-in `math` reward hook labels ended sessions, and whether labelling slows the proxy.

For each database (a SQLite file; a scratch Postgres database) and count of math-verify worker processes,
a `flywheel proxy` (hook runner inside: `rewards.runner.workers`, `concurrency=8`, `poll_interval_s=0.05`)
is started in front of the scripted worker. Then, at each load (closed-loop chat clients, as
benchmarks/proxy_overhead.py runs them): `--sessions` sessions are created over the RL API with
`reward={"hook": "math"}` and a reference answer, each with one completion written straight to storage
(a GSM8K-style answer, half right, half wrong: `#### n`, `\\boxed{n}`, fractions against decimals); the
load's chat p50/p99 is measured for `--seconds` with no hook work; then, the load still running, every
session is ended at once (concurrent REST calls) and chat calls are timed until every hook job is done.
A session's lag is its reward's `created_at` minus its `ended_at`; sessions labelled per second =
sessions / (last reward written - first session ended). Each session must have exactly one `hook:math`
reward, 1 if its answer was right and 0 if wrong, or the benchmark fails. Each proxy first labels a few
sessions untimed (its pool's workers started, math-verify imported). Load, end calls and polling share
this process.

`--runners` says where hooks run: "proxy" (inside it, as a standalone `flywheel proxy` does), "process"
(a `flywheel rewards run` beside it, with `rewards.runner.in_proxy=false`, as `flywheel up` does), and
"rest", the baseline without hooks: every session is rewarded over REST, then ended, and timed until
finalized (its lag is from its end to its first trajectory), which is what ending and finalizing cost the
proxy whoever grades.

    .venv/bin/python benchmarks/reward_hooks.py [--quick] [--only sqlite,postgres] [--workers 1,2]
        [--runners proxy,process,rest] [--clients 1,16] [--sessions 400] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np
from sqlalchemy import Select, func, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import stacks
from benchmarks.overhead.load import Measurement, Target, chat_target, measure_while
from benchmarks.overhead.stacks import Server
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.models import JobState, Reward, RewardJob, Session, SessionStatus, Trajectory, as_utc
from storage.queries import record_completions
from storage.records import CompletionRecord

DATABASES = ("sqlite", "postgres")
RUNNER = ("rewards.runner.concurrency=8", "rewards.runner.poll_interval_s=0.05")
SOURCE = "hook:math"
SETTLED = (JobState.DONE.value, JobState.FAILED.value)
_CREATE_CONCURRENCY = 16
_POLL_S = 0.1
_WARM_SESSIONS_PER_WORKER = 4


@dataclass(frozen=True)
class Answer:
    """A session's recorded answer, its reference, and whether the answer is right."""

    text: str
    gold: str
    right: bool


def answer(i: int) -> Answer:
    """The `i`-th session's answer: right for even `i`, wrong for odd; GSM8K's `#### n`, `\\boxed{n}` with
    thousands separators, and fractions against a decimal reference, in turn."""
    right, n, kind = i % 2 == 0, 10 + i, (i // 2) % 4
    if kind == 0:
        text = f"She buys {n} - 3 = {n - 3} pens, then 3 more.\n#### {n if right else n + 1}"
        return Answer(text, str(n), right)
    if kind == 1:
        text = f"So the total is \\boxed{{{1000 + n + (0 if right else 9):,}}} dollars."
        return Answer(text, str(1000 + n), right)
    if kind == 2:
        top = 1 + n % 3  # quarters against 0.25, 0.5, 0.75
        text = f"Each gets \\boxed{{\\frac{{{top}}}{{{4 if right else 3}}}}} of the cake."
        return Answer(text, str(top / 4), right)
    eighths = 1 + 2 * (n % 4)  # eighths against 0.125, 0.375, ...
    text = f"The share is {eighths} out of 8.\n#### {eighths}/{8 if right else 9}"
    return Answer(text, str(eighths / 8), right)


@dataclass(frozen=True)
class Labelled:
    """What the database says about one labelled batch."""

    lags_ms: list[float]
    """reward.created_at - session.ended_at of each session, in ms."""
    seconds: float
    """Last reward written - first session ended."""
    right: int


@dataclass(frozen=True)
class Row:
    """One database, runner placement, worker count and load: labelling speed and lag, chat latency idle
    and labelling."""

    database: str
    runner: str
    """"proxy": the hook runner inside the proxy; "process": `flywheel rewards run` beside it; "rest": no
    hooks, every session rewarded over REST then ended (its lag: end to first trajectory)."""
    workers: int
    clients: int
    sessions: int
    labelled_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    right: int
    baseline_p50_ms: float
    baseline_p99_ms: float
    during_p50_ms: float
    during_p99_ms: float
    after_ends_p50_ms: float
    """Of the chat calls during labelling that started once every end call was answered."""
    after_ends_p99_ms: float
    baseline_calls: int
    during_calls: int
    after_ends_calls: int
    errors: int
    first_error: str | None


def _completion(session_id: str, text: str) -> CompletionRecord:
    return CompletionRecord(
        id=f"chatcmpl-bench-{session_id}", session_id=session_id, parent_id=None, prompt_ids=[1, 2, 3],
        output_ids=[4, 5], output_logprobs=np.zeros(2, np.float32), output_versions=[0, 0],
        finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1,
        request_json={"messages": [{"role": "user", "content": "Solve the problem."}]},
        response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]},
    )


async def create_batch(
    http: aiohttp.ClientSession, base_url: str, factory: SessionFactory, answers: Sequence[Answer],
    hooked: bool = True,
) -> list[str]:
    """Sessions with the math hook (or, not `hooked`, none) and a reference answer (over REST), each with its
    recorded answer."""
    gate = asyncio.Semaphore(_CREATE_CONCURRENCY)

    async def create(item: Answer) -> str:
        body = {"metadata": {"answer": item.gold}, "reward": {"hook": "math"} if hooked else []}
        async with gate, http.post(f"{base_url}/rl/v1/sessions", json=body) as response:
            if response.status != 201:
                raise RuntimeError(f"creating a session: HTTP {response.status}: {await response.text()}")
            return str((await response.json())["session_id"])

    ids = list(await asyncio.gather(*(create(item) for item in answers)))
    records = [_completion(sid, item.text) for sid, item in zip(ids, answers, strict=True)]
    await record_completions(factory, records)
    return ids


async def reward_all(
    http: aiohttp.ClientSession, base_url: str, ids: Sequence[str], answers: Sequence[Answer]
) -> None:
    """The REST baseline: every session's reward posted at once, as a client that grades itself does."""

    async def post(session_id: str, item: Answer) -> None:
        body = {"value": 1.0 if item.right else 0.0}
        async with http.post(f"{base_url}/rl/v1/sessions/{session_id}/reward", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"rewarding {session_id}: HTTP {response.status}: {await response.text()}")

    await asyncio.gather(*(post(sid, item) for sid, item in zip(ids, answers, strict=True)))


async def check_rest(factory: SessionFactory, ids: Sequence[str], answers: Sequence[Answer]) -> Labelled:
    """The REST baseline's batch: every session finalized with its one REST reward; its lag is from its
    end to its first trajectory (trainable), the span from first end to last trajectory."""
    first_trajectory = func.min(Trajectory.created_at)
    async with factory() as db:
        rewards = {str(sid): float(value) for sid, value in (await db.execute(
            select(Reward.session_id, Reward.value).where(Reward.session_id.in_(ids)))).all()}
        written = {str(sid): as_utc(at) for sid, at in (await db.execute(
            select(Trajectory.session_id, first_trajectory).where(Trajectory.session_id.in_(ids))
            .group_by(Trajectory.session_id))).all()}
        ends = (await db.execute(select(Session.id, Session.ended_at).where(Session.id.in_(ids)))).all()
        ended = {str(sid): as_utc(at) for sid, at in ends if at is not None}
    problems = [sid for sid, item in zip(ids, answers, strict=True)
                if rewards.get(sid) != (1.0 if item.right else 0.0) or sid not in written or sid not in ended]
    if problems:
        raise RuntimeError(f"{len(problems)} sessions not rewarded and finalized: {problems[:5]}")
    lags_ms = [(written[sid] - ended[sid]).total_seconds() * 1000 for sid in ids]
    span = (max(written.values()) - min(ended.values())).total_seconds()
    return Labelled(lags_ms, span, sum(item.right for item in answers))


async def end_all(http: aiohttp.ClientSession, base_url: str, ids: Sequence[str]) -> None:
    """End every session at once (one concurrent REST call each)."""

    async def end(session_id: str) -> None:
        async with http.post(f"{base_url}/rl/v1/sessions/{session_id}/end") as response:
            if response.status != 200 or not (await response.json())["ended"]:
                raise RuntimeError(f"ending {session_id}: HTTP {response.status}: {await response.text()}")

    await asyncio.gather(*(end(session_id) for session_id in ids))


async def wait_until(factory: SessionFactory, query: Select[int], expected: int, what: str,
                     timeout_s: float) -> None:
    """Poll the count `query` until it is `expected` (RuntimeError after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with factory() as db:
            seen = int((await db.execute(query)).scalar_one())
        if seen == expected:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {seen} of {expected} after {timeout_s:.0f} s")
        await asyncio.sleep(_POLL_S)


def settled(ids: Sequence[str]) -> Select[int]:
    """How many of the sessions' hook jobs are done or failed."""
    return select(func.count()).select_from(RewardJob).where(
        RewardJob.session_id.in_(ids), RewardJob.state.in_(SETTLED))


def finalized(ids: Sequence[str]) -> Select[int]:
    """How many of the sessions are finalized."""
    return select(func.count()).select_from(Session).where(
        Session.id.in_(ids), Session.status == SessionStatus.FINALIZED.value)


async def check_labels(factory: SessionFactory, ids: Sequence[str], answers: Sequence[Answer]) -> Labelled:
    """Every session's job done and exactly one `hook:math` reward, 1 where its answer is right and 0 where
    wrong (RuntimeError otherwise); the lags and the span from first end to last reward."""
    async with factory() as db:
        jobs = (await db.execute(select(RewardJob.session_id, RewardJob.state, RewardJob.error)
                                 .where(RewardJob.session_id.in_(ids)))).all()
        rewards = (await db.execute(select(Reward.session_id, Reward.value, Reward.created_at)
                                    .where(Reward.session_id.in_(ids), Reward.source == SOURCE))).all()
        sessions = await db.execute(select(Session.id, Session.ended_at).where(Session.id.in_(ids)))
        ended: dict[str, datetime | None] = {sid: at for sid, at in sessions.all()}
    problems = [f"{sid}'s job is {state}: {error}" for sid, state, error in jobs if state != JobState.DONE]
    if len(jobs) != len(ids):
        problems.append(f"{len(jobs)} hook jobs for {len(ids)} sessions")
    by_session: dict[str, list[tuple[float, datetime]]] = {}
    for session_id, value, created_at in rewards:
        by_session.setdefault(str(session_id), []).append((value, as_utc(created_at)))
    lags_ms: list[float] = []
    ends: list[datetime] = []
    written: list[datetime] = []
    for session_id, item in zip(ids, answers, strict=True):
        got = by_session.get(session_id, [])
        if len(got) != 1:
            problems.append(f"{session_id} has {len(got)} {SOURCE} rewards")
            continue
        value, created_at = got[0]
        if value != (1.0 if item.right else 0.0):
            problems.append(f"{session_id} labelled {value} for {item.text!r} against {item.gold!r}")
        ended_at = ended[session_id]
        if ended_at is None:
            problems.append(f"{session_id} has no ended_at")
            continue
        lags_ms.append((created_at - as_utc(ended_at)).total_seconds() * 1000)
        ends.append(as_utc(ended_at))
        written.append(created_at)
    if problems:
        raise RuntimeError(f"{len(problems)} labelling problem(s): " + "; ".join(problems[:10]))
    right = sum(item.right for item in answers)  # each one checked above
    return Labelled(lags_ms, (max(written) - min(ends)).total_seconds(), right)


@dataclass(frozen=True)
class Chat:
    """The chat calls timed at one load: idle, while a batch is labelled, and those of the latter that
    started once every end call was answered (the runner at work, the burst of end calls over)."""

    idle: Measurement
    labelling: Measurement
    after_ends_ms: np.ndarray


async def label(
    server: Server, db_url: str, answers: Sequence[Answer], load: tuple[Target, int, float, float] | None,
    rest: bool = False,
) -> tuple[Labelled, Chat | None]:
    """Create, end and check one batch of sessions; with `load` (target, clients, baseline seconds,
    warm-up seconds), the chat calls timed before (no hook work) and while the batch is labelled. `rest`:
    the baseline without hooks, each session rewarded over REST before its end, timed until finalized."""
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    timeout_s = 120 + 2.0 * len(answers)
    engine = create_engine(StorageConfig(url=db_url))
    factory = create_sessionmaker(engine)
    try:
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as http:
            ids = await create_batch(http, server.url, factory, answers, hooked=not rest)
            ends_answered = [0.0]

            async def labelling() -> None:
                if rest:
                    await reward_all(http, server.url, ids, answers)
                await end_all(http, server.url, ids)
                ends_answered[0] = time.perf_counter()
                if rest:
                    await wait_until(factory, finalized(ids), len(ids), "sessions finalized", timeout_s)
                else:
                    await wait_until(factory, settled(ids), len(ids), "hook jobs settled", timeout_s)

            chat = None
            if load is None:
                await labelling()
            else:
                target, clients, seconds, warmup_s = load
                idle, _ = await measure_while(target, clients, warmup_s, lambda: asyncio.sleep(seconds))
                starts: list[float] = []
                during, _ = await measure_while(target, clients, warmup_s, labelling, starts=starts)
                chat = Chat(idle, during, during.latencies_ms[np.array(starts) >= ends_answered[0]])
            labelled = await (check_rest if rest else check_labels)(factory, ids, answers)
            # Finalizing follows labelling: the next baseline starts with neither at work.
            await wait_until(factory, finalized(ids), len(ids), "sessions finalized", timeout_s)
    finally:
        await engine.dispose()
    return labelled, chat


def _percentiles(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """p50 and p99 of `values`; NaN without any."""
    p50, p99 = np.percentile(values, [50, 99]) if len(values) else (np.nan, np.nan)
    return float(p50), float(p99)


def _row(database: str, runner: str, workers: int, clients: int, labelled: Labelled, chat: Chat) -> Row:
    idle, during = chat.idle, chat.labelling
    return Row(
        database, runner, workers, clients, len(labelled.lags_ms), len(labelled.lags_ms) / labelled.seconds,
        *_percentiles(labelled.lags_ms), labelled.right, *_percentiles(idle.latencies_ms),
        *_percentiles(during.latencies_ms), *_percentiles(chat.after_ends_ms), idle.ok, during.ok,
        len(chat.after_ends_ms), idle.errors + during.errors, idle.first_error or during.first_error,
    )


@contextlib.contextmanager
def hook_runner(logs: Path, db_url: str, settings: Sequence[str]) -> Iterator[None]:
    """`flywheel rewards run` on `db_url` with `settings`, until the block ends (healthy once it serves
    its metrics)."""
    port = stacks.free_port()
    argv = [sys.executable, "-m", "flywheel.cli", "rewards", "run", "--metrics-port", str(port),
            f"storage.url={db_url}", "run.log_level=WARNING", *settings]
    with stacks.process(argv, f"http://127.0.0.1:{port}/metrics", logs / "rewards-run.log"):
        yield


def run_database(args: argparse.Namespace, database: str, worker: Server, logs: Path) -> Iterator[Row]:
    """The rows of one database: a fresh proxy (and database) per worker count, every load in turn."""
    scratch_database = stacks.sqlite_database if database == "sqlite" else stacks.postgres_database
    for runner, workers in itertools.product(args.runners, args.workers):
        if runner == "rest" and workers != args.workers[0]:
            continue  # no hooks: the worker count does not matter
        settings: tuple[str, ...] = (*RUNNER, f"rewards.runner.workers={workers}")
        if runner == "process":
            settings = (*settings, "rewards.runner.in_proxy=false")
        with scratch_database() as db_url, stacks.flywheel_proxy(
            logs, db_url, worker.url, max(args.clients), settings=settings
        ) as server, hook_runner(logs, db_url, settings) if runner == "process" else contextlib.nullcontext():
            numbers = itertools.count()
            warm = [answer(next(numbers)) for _ in range(_WARM_SESSIONS_PER_WORKER * workers)]
            asyncio.run(label(server, db_url, warm, None, rest=runner == "rest"))
            for clients in args.clients:
                answers = [answer(next(numbers)) for _ in range(args.sessions)]
                target = chat_target(server.url, "tiny", args.max_tokens, False, server.keys)
                labelled, chat = asyncio.run(
                    label(server, db_url, answers, (target, clients, args.seconds, args.warmup),
                          rest=runner == "rest")
                )
                assert chat is not None
                row = _row(database, runner, workers, clients, labelled, chat)
                print(f"  {table_row(row)}", flush=True)
                yield row


HEADER = (
    "| database | runner | workers | chat clients | sessions | right | labelled/s | lag p50 ms | lag p99 ms "
    "| chat p50 ms idle → labelling | chat p99 ms idle → labelling | chat p50 / p99 ms after the ends "
    "| chat calls idle, labelling, after the ends | errors |\n"
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def table_row(r: Row) -> str:
    """`r` as a row of the markdown table under HEADER."""
    return (
        f"| {r.database} | {r.runner} | {r.workers} | {r.clients} | {r.sessions} | {r.right} "
        f"| {r.labelled_per_s:.1f} "
        f"| {r.lag_p50_ms:.0f} | {r.lag_p99_ms:.0f} | {r.baseline_p50_ms:.2f} → {r.during_p50_ms:.2f} "
        f"| {r.baseline_p99_ms:.2f} → {r.during_p99_ms:.2f} "
        f"| {r.after_ends_p50_ms:.2f} / {r.after_ends_p99_ms:.2f} "
        f"| {r.baseline_calls}, {r.during_calls}, {r.after_ends_calls} | {r.errors} |"
    )


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100 sessions per load, 2 s baselines")
    parser.add_argument("--only", default=",".join(DATABASES), help="comma-separated: sqlite, postgres")
    parser.add_argument("--workers", type=_ints, default=[1, 2], help="math-verify worker processes")
    parser.add_argument("--runners", default="proxy,process,rest",
                        help="where hooks run: proxy (inside it), process (`flywheel rewards run` beside "
                             "it); rest: no hooks, each session rewarded over REST (the baseline)")
    parser.add_argument("--clients", type=_ints, default=[1, 16], help="chat clients of each load")
    parser.add_argument("--sessions", type=int, default=None, help="sessions labelled per load (400)")
    parser.add_argument("--seconds", type=float, default=None, help="baseline seconds per load (5)")
    parser.add_argument("--warmup", type=float, default=None, help="untimed load seconds first (1)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.sessions = args.sessions if args.sessions is not None else (100 if args.quick else 400)
    args.seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    args.runners = [name.strip() for name in args.runners.split(",") if name.strip()]
    if set(args.runners) - {"proxy", "process", "rest"}:
        parser.error("--runners takes proxy, process and/or rest")
    unknown = sorted(set(args.only) - set(DATABASES))
    if unknown:
        parser.error(f"unknown database(s) {', '.join(unknown)}; choose from {', '.join(DATABASES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="reward-hooks-") as scratch:
        logs = Path(scratch)
        try:
            with stacks.worker(logs) as worker:
                for database in args.only:
                    print(f"{database}:", flush=True)
                    rows.extend(run_database(args, database, worker, logs))
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    table = "\n".join([HEADER, *map(table_row, rows)])
    print(f"\n{table}\n\n(ran {time.monotonic() - started:.0f} s)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {key: value for key, value in vars(args).items() if key != "json"}
        records = [
            {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in asdict(row).items()}
            for row in rows
        ]
        payload = {"config": {**config, "cpus": os.cpu_count()}, "rows": records, "markdown": table}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"(written to {args.json})")


if __name__ == "__main__":
    main()
