"""Online training with the tiny model: how long from the feedback that completes a batch until a promoted
version is serving, and what serving latency users see while training and evaluation run beside it.

The same loop as tests/integration/test_online_loop.py: CPU engines on the tiny model (one serving, one
for evaluations), the proxy on SQLite, simulated users on online keys who send feedback 0.1-2.5 s after
each answer, the trainer in this process with eval-gated promotion (B = `--batch` samples per step,
running baselines). Phases: `serving only` (no trainer) for a baseline of chat latency, then `online`
(trainer, evaluations and pushes beside the traffic).

For each promoted version (its consumed samples → their completions → their feedback), from the last
feedback of its batch: `finalize` until its last sample was written (grace, hooks), `train` the step
(train + save, from the step's metrics), `eval` and `push` (from its evaluation), `other` the rest
(claim polling, recording), and `total` until it was serving.

    .venv/bin/python benchmarks/online_loop.py [--seconds 90] [--batch 4] [--users 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.auth import create_online_key
from proxy.config import ProxyConfig
from proxy.server import serve_proxy_in_thread
from rewards.config import FinalizerConfig, RewardsConfig
from serving.config import ServingConfig
from serving.models.tiny import build_tiny_model
from storage import migrate
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.keys import load_key_hasher
from storage.models import Feedback, PolicyVersion, TrainStep, Trajectory
from tests.support.online_loop import (
    LocalPolicy,
    SimulatedUsers,
    gated_driver,
    online_trainer_config,
    two_engines,
)

RESULTS = Path(__file__).resolve().parent / "results" / "online_loop.json"


@dataclass(frozen=True)
class Promotion:
    version: int
    finalize_s: float
    train_s: float
    eval_s: float
    push_s: float
    other_s: float
    total_s: float


def p50(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p95(values: Sequence[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 20 else float("nan")


async def promotions(session_factory: SessionFactory) -> list[Promotion]:
    """One row per promoted version trained here (version 0 excluded), measured from its batch's last
    feedback."""
    found = []
    async with session_factory() as db:
        versions = (await db.scalars(select(PolicyVersion).where(PolicyVersion.status == "promoted"))).all()
        for version in versions:
            if version.version == 0 or version.served_at is None:
                continue
            step = await db.get(TrainStep, version.version)
            samples = (
                await db.scalars(select(Trajectory).where(Trajectory.consumed_step == version.version))
            ).all()
            completion_ids = [cid for t in samples for cid in t.completion_ids or ()]
            feedback = (
                await db.scalars(
                    select(Feedback.created_at).where(Feedback.completion_id.in_(completion_ids))
                )
            ).all()
            if step is None or not samples or not feedback:
                continue
            last_feedback = max(feedback)
            finalized = max(t.created_at for t in samples)
            details = version.eval_details or {}
            parts = {
                "finalize_s": max((finalized - last_feedback).total_seconds(), 0.0),
                "train_s": step.metrics.get("perf/train_s", 0.0) + step.metrics.get("perf/save_s", 0.0),
                "eval_s": float(details.get("eval_s", 0.0)),
                "push_s": float(details.get("push_s", 0.0)),
            }
            total = (version.served_at - last_feedback).total_seconds()
            found.append(
                Promotion(
                    version.version, **parts, other_s=max(total - sum(parts.values()), 0.0), total_s=total
                )
            )
    return found


async def run_phase(base_url: str, keys: Sequence[str], seconds: float) -> list[float]:
    users = SimulatedUsers(base_url, keys)
    stop = asyncio.Event()
    task = asyncio.create_task(users.run(stop))
    await asyncio.sleep(seconds)
    stop.set()
    stats = await task
    return stats.latencies_s


async def main_async(args: argparse.Namespace, work: Path) -> dict[str, object]:
    model_dir = build_tiny_model(work / "model")
    db_url = f"sqlite+aiosqlite:///{work / 'online.db'}"
    await asyncio.to_thread(migrate.upgrade, db_url)
    storage = StorageConfig(url=db_url)
    engine = create_engine(storage)
    session_factory = create_sessionmaker(engine)
    hasher = await asyncio.to_thread(load_key_hasher, storage)
    keys = [await create_online_key(session_factory, hasher) for _ in range(args.users)]
    serving = ServingConfig(model=str(model_dir))
    finalizer = FinalizerConfig(reward_grace_s=3.0, session_ttl_s=30.0, sweep_interval_s=0.5)
    with ExitStack() as stack:
        serving_url, eval_url = stack.enter_context(two_engines(model_dir))
        proxied = serving.model_copy(update={"worker_urls": [serving_url]})
        proxy = ProxyConfig(port=0, finalizer=finalizer)
        base_url = stack.enter_context(
            serve_proxy_in_thread(proxy, storage, proxied, rewards_config=RewardsConfig())
        )
        baseline = await run_phase(base_url, keys, args.baseline_seconds)
        config = online_trainer_config(batch_size=args.batch, margin=0.02)
        stop = asyncio.Event()
        policy = LocalPolicy(model_dir, config)
        async with gated_driver(
            config, session_factory, policy, serving_url, eval_url, model_dir, work
        ) as driver:
            training = asyncio.create_task(driver.run(stop))
            online = await run_phase(base_url, keys, args.seconds)
            stop.set()
            await training
        rows = await promotions(session_factory)
        async with session_factory() as db:
            statuses = [v.status for v in (await db.scalars(select(PolicyVersion))).all()]
    await engine.dispose()
    return {
        "batch": args.batch,
        "users": args.users,
        "seconds": args.seconds,
        "versions": {status: statuses.count(status) for status in sorted(set(statuses))},
        "promotions": [asdict(row) for row in rows],
        "p50": {
            field: p50([getattr(row, field) for row in rows])
            for field in Promotion.__dataclass_fields__
            if field != "version"
        },
        "serving_p50_ms": {"serving only": 1000 * p50(baseline), "online": 1000 * p50(online)},
        "serving_p95_ms": {"serving only": 1000 * p95(baseline), "online": 1000 * p95(online)},
        "calls": {"serving only": len(baseline), "online": len(online)},
    }


def table(result: dict[str, object]) -> str:
    p = result["p50"]
    assert isinstance(p, dict)
    lines = [
        f"online loop, tiny model, B={result['batch']}, {result['users']} users, {result['seconds']} s; "
        f"versions: {result['versions']}",
        "",
        "| from the batch's last feedback (p50, s) | finalize | train | eval | push | other | total |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        "| to a promoted version serving | "
        + " | ".join(
            f"{p[k]:.2f}" for k in ("finalize_s", "train_s", "eval_s", "push_s", "other_s", "total_s")
        )
        + " |",
        "",
        "| chat latency (ms) | calls | p50 | p95 |",
        "| --- | --- | --- | --- |",
    ]
    calls, p50s, p95s = result["calls"], result["serving_p50_ms"], result["serving_p95_ms"]
    assert isinstance(calls, dict) and isinstance(p50s, dict) and isinstance(p95s, dict)
    for phase in ("serving only", "online"):
        lines.append(f"| {phase} | {calls[phase]} | {p50s[phase]:.1f} | {p95s[phase]:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="online phase length")
    parser.add_argument("--baseline-seconds", type=float, default=30.0, help="serving-only phase length")
    parser.add_argument("--batch", type=int, default=4, help="B: samples per training step")
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="online-loop-") as work:
        result = asyncio.run(main_async(args, Path(work)))
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
