"""Asynchronous vs synchronous RL under admission control: wall-clock time to N training steps, and the
reward the final policy earns, for η = 0 (synchronous), 2 and 4 in one run, with the same agents.

Each η gets a fresh stack in this process: a CPU engine on the tiny model (serving/models/tiny.py), the
proxy on SQLite with admission control on (B = `--batch`, its η), and the trainer's driver with the
policy in this process (tests/support/online_loop.py `LocalPolicy`). Tasks come as GRPO groups of B
sessions, opened through the RL API (a 429 is waited out by its `retry-after-ms`) whenever no session is
waiting for an agent, so each step trains on exactly one whole group. `--agents` agents (the same number
for every η) take sessions as they come and run an episode each: ask the model, call a tool whose latency
is long-tailed (lognormal, median `--tool-median` s, σ `--tool-sigma`, clipped to 0.2-10 s), ask the model
again with the tool's result, reward the session with the fraction of its answers' tokens drawn from 64
target token ids (dense and verifiable; the random model starts near 64/1030) and end it. One session is
one trajectory: the second call extends the first token-exactly (token 191, which decodes to a NUL no
JSON body may carry back, is banned with `logit_bias`).

Synchronous training (η = 0) admits one group per policy version, so every step waits for the slowest
tool call of its group while the other agents idle, and the agents wait while it trains. With η > 0 up
to η + 1 groups run ahead; the trainer drops samples that still went stale (counted). Final reward: the
mean target fraction of `--eval` answers sampled (temperature 1) from the last version, through the
proxy on an admin key (never trained on); N = 24 lets every η converge (at 16 the stale runs still
lagged a few steps behind on this fast-learning task). The table gives the speed-up over η = 0. The
agents count (24 = 3 groups) is the same for every η: synchronous training leaves two thirds of it idle.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 24] [--batch 8] [--agents 24] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.auth import create_admin_key
from proxy.config import AdmissionConfig, ProxyConfig
from proxy.server import serve_proxy_in_thread
from rewards.config import FinalizerConfig, RewardsConfig
from serving.client import WorkerPool
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from serving.models.tiny import build_tiny_model
from storage import migrate
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.keys import load_key_hasher
from storage.models import TrainStep, Trajectory
from tests.support.online_loop import LocalPolicy, target_fraction
from trainer.config import TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor

RESULTS = Path(__file__).resolve().parent / "results" / "async_vs_sync.json"
NUL_TOKEN = 191  # the tiny tokenizer's token that decodes to "\x00"
ETAS = (0, 2, 4)


@dataclass
class AgentStats:
    episodes: int = 0
    refused: int = 0  # 429s waited out
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunResult:
    eta: int
    steps: int
    wall_s: float
    s_per_step: float
    final_reward: float
    train_reward_first: float  # mean reward/mean of the first 3 steps' batches
    train_reward_last: float  # and of the last 3
    trainer_s_per_step: float  # mean perf/step_s: train, save and push of one step
    max_staleness: float
    dropped: int
    refused: int
    episodes: int
    trajectories: int
    errors: int


def tool_latency(rng: random.Random, median_s: float, sigma: float) -> float:
    """A long-tailed tool call: lognormal around `median_s`, clipped to 0.2-10 s."""
    return min(max(rng.lognormvariate(0.0, sigma) * median_s, 0.2), 10.0)


async def open_group(http: httpx.AsyncClient, admin_key: str, size: int, task: str, stats: AgentStats) -> Any:
    """POST /rl/v1/groups, waiting out admission control's 429s as their `retry-after-ms` says."""
    while True:
        answer = await http.post("/rl/v1/groups", json={"size": size, "task": task},
                                  headers={"Authorization": f"Bearer {admin_key}"})
        if answer.status_code != 429:
            answer.raise_for_status()
            return answer.json()
        stats.refused += 1
        await asyncio.sleep(float(answer.headers["retry-after-ms"]) / 1000)


async def open_groups(
    http: httpx.AsyncClient, admin_key: str, size: int, waiting: asyncio.Queue[tuple[str, dict[str, Any]]],
    stats: AgentStats,
) -> None:
    """A new group of `size` sessions whenever none is left waiting for an agent, until cancelled."""
    for number in itertools.count():
        await waiting.join()  # every session handed out to an agent
        task = f"task {number}: use the tool"
        group = await open_group(http, admin_key, size, task, stats)
        for session in group["sessions"]:
            waiting.put_nowait((task, session))


async def chat(http: httpx.AsyncClient, key: str, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
            "logit_bias": {str(NUL_TOKEN): -100}, "return_token_ids": True}
    answer = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    answer.raise_for_status()
    return answer.json()["choices"][0]


async def agent(
    index: int, http: httpx.AsyncClient, waiting: asyncio.Queue[tuple[str, dict[str, Any]]],
    args: argparse.Namespace, stats: AgentStats,
) -> None:
    """Episodes until cancelled: answer, tool call, answer, reward, end."""
    rng = random.Random(args.seed * 1000 + index)
    while True:
        task, session = await waiting.get()
        waiting.task_done()
        key, session_id = session["api_key"], session["session_id"]
        try:
            messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
            first = await chat(http, key, messages, args.max_tokens)
            await asyncio.sleep(tool_latency(rng, args.tool_median, args.tool_sigma))
            messages += [{"role": "assistant", "content": first["message"]["content"] or ""},
                         {"role": "user", "content": f"tool result {rng.randrange(100)}"}]
            second = await chat(http, key, messages, args.max_tokens)
            value = target_fraction([*first.get("token_ids", []), *second.get("token_ids", [])])
            headers = {"Authorization": f"Bearer {key}"}
            (await http.post(f"/rl/v1/sessions/{session_id}/reward", json={"value": value},
                             headers=headers)).raise_for_status()
            (await http.post(f"/rl/v1/sessions/{session_id}/end", headers=headers)).raise_for_status()
            stats.episodes += 1
        except httpx.HTTPError as exc:  # ended unrewarded: it frees its slot once finalized
            stats.errors.append(f"{type(exc).__name__}: {exc}")
            await http.post(f"/rl/v1/sessions/{session_id}/end", headers={"Authorization": f"Bearer {key}"})


async def final_reward(http: httpx.AsyncClient, admin_key: str, count: int, max_tokens: int) -> float:
    """Mean target fraction of `count` sampled answers of the served (last) version, on one-off admin
    sessions that are never trained on."""
    values = []
    for i in range(count):
        choice = await chat(http, admin_key, [{"role": "user", "content": f"evaluation {i}"}], max_tokens)
        values.append(target_fraction(choice.get("token_ids", [])))
    return statistics.fmean(values)


async def step_metrics(session_factory: SessionFactory) -> list[dict[str, float]]:
    async with session_factory() as db:
        return list((await db.scalars(select(TrainStep.metrics).order_by(TrainStep.step))).all())


async def counts(session_factory: SessionFactory) -> tuple[int, int]:
    """(trajectories, dropped trajectories)."""
    async with session_factory() as db:
        trajectories = await db.scalar(select(func.count()).select_from(Trajectory))
        dropped = await db.scalar(
            select(func.count()).select_from(Trajectory).where(Trajectory.dropped_at.is_not(None))
        )
    return int(trajectories or 0), int(dropped or 0)


async def run_eta(eta: int, args: argparse.Namespace, model_dir: Path, work: Path) -> RunResult:
    await asyncio.to_thread(work.mkdir, parents=True)
    db_url = f"sqlite+aiosqlite:///{work / 'flywheel.db'}"
    await asyncio.to_thread(migrate.upgrade, db_url)
    storage = StorageConfig(url=db_url)
    engine = create_engine(storage)
    session_factory = create_sessionmaker(engine)
    hasher = await asyncio.to_thread(load_key_hasher, storage)
    admin_key = await create_admin_key(session_factory, hasher)
    serving = ServingConfig(model=str(model_dir), cpu=CpuEngineConfig(num_threads=1, max_batch_size=32))
    proxy = ProxyConfig(
        port=0,
        finalizer=FinalizerConfig(sweep_interval_s=0.2, reward_grace_s=5.0),
        admission=AdmissionConfig(enabled=True, batch_size=args.batch, max_head_offpolicyness=eta,
                                  retry_after_s=args.retry_after),
    )
    config = TrainerConfig(batch_size=args.batch, max_head_offpolicyness=eta, total_steps=args.steps,
                           lr=1e-2, num_threads=1, seed=args.seed, poll_interval_s=0.05, keep_checkpoints=2)
    stats = AgentStats()
    with ExitStack() as stack:
        app = create_engine_app(serving, load_model(str(model_dir)))
        engine_url = stack.enter_context(serve_in_thread(app))
        proxied = serving.model_copy(update={"worker_urls": [engine_url]})
        base_url = stack.enter_context(
            serve_proxy_in_thread(proxy, storage, proxied, rewards_config=RewardsConfig())
        )
        policy = LocalPolicy(model_dir, config)
        limits = httpx.Limits(max_connections=args.agents + 8)
        async with (
            httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http,
            WorkerPool(ClientConfig(), [engine_url]) as pool,
        ):
            driver = Driver(config, session_factory, policy, pool.clients, work / "ckpt",
                            Monitor(work / "metrics.jsonl"))
            started = time.perf_counter()
            training = asyncio.create_task(driver.run())
            waiting: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
            agents = [asyncio.create_task(agent(i, http, waiting, args, stats)) for i in range(args.agents)]
            agents.append(asyncio.create_task(open_groups(http, admin_key, args.batch, waiting, stats)))
            await training
            wall = time.perf_counter() - started
            for task in agents:
                task.cancel()
            await asyncio.gather(*agents, return_exceptions=True)
            reward = await final_reward(http, admin_key, args.eval, args.max_tokens)
    metrics = await step_metrics(session_factory)
    trajectories, dropped = await counts(session_factory)
    await engine.dispose()
    train = [m["reward/mean"] for m in metrics]
    return RunResult(
        eta=eta, steps=len(metrics), wall_s=wall, s_per_step=wall / max(len(metrics), 1),
        final_reward=reward,
        train_reward_first=statistics.fmean(train[:3]), train_reward_last=statistics.fmean(train[-3:]),
        trainer_s_per_step=statistics.fmean(m["perf/step_s"] for m in metrics),
        max_staleness=max(m["staleness/max"] for m in metrics), dropped=dropped, refused=stats.refused,
        episodes=stats.episodes, trajectories=trajectories, errors=len(stats.errors),
    )


async def main_async(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = build_tiny_model(work / "model", seed=0)
    runs = [await run_eta(eta, args, model_dir, work / f"eta{eta}") for eta in args.etas]
    sync = next((run for run in runs if run.eta == 0), runs[0])
    initial = runs[0].train_reward_first
    return {
        "steps": args.steps, "batch": args.batch, "agents": args.agents, "tool_median_s": args.tool_median,
        "tool_sigma": args.tool_sigma, "max_tokens": args.max_tokens, "eval_answers": args.eval,
        "initial_train_reward": initial,
        "runs": [{**asdict(run), "speedup": sync.wall_s / run.wall_s} for run in runs],
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"async vs sync, tiny model: {result['steps']} steps of B = {result['batch']}, "
        f"{result['agents']} agents, tool latency lognormal median {result['tool_median_s']} s "
        f"σ {result['tool_sigma']} (0.2-10 s)",
        "",
        "| η | wall (s) | s/step | trainer s/step | speed-up vs η=0 | final reward "
        "| train reward first → last | max staleness | dropped | 429s | episodes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {run['eta']} | {run['wall_s']:.1f} | {run['s_per_step']:.2f} "
            f"| {run['trainer_s_per_step']:.2f} | {run['speedup']:.2f}× "
            f"| {run['final_reward']:.3f} | {run['train_reward_first']:.3f} → {run['train_reward_last']:.3f} "
            f"| {run['max_staleness']:.0f} | {run['dropped']} | {run['refused']} | {run['episodes']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="N: training steps per run")
    parser.add_argument("--batch", type=int, default=8, help="B: sessions per group, one group per step")
    parser.add_argument("--agents", type=int, default=24, help="concurrent agents, the same for every η")
    parser.add_argument("--etas", type=int, nargs="+", default=list(ETAS), help="η values to run")
    parser.add_argument("--tool-median", type=float, default=2.0, help="median tool latency (s)")
    parser.add_argument("--tool-sigma", type=float, default=1.0, help="lognormal σ of the tool latency")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per model answer")
    parser.add_argument("--retry-after", type=float, default=0.25, help="admission's Retry-After (s)")
    parser.add_argument("--eval", type=int, default=48, help="answers sampled to score the final policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, nargs="?", const=RESULTS, default=None,
                        help="write the results as JSON (no path: benchmarks/results/async_vs_sync.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rewards.finalizer").setLevel(logging.ERROR)  # the eval answers are never rewarded
    with tempfile.TemporaryDirectory(prefix="async-vs-sync-") as work:
        result = asyncio.run(main_async(args, Path(work)))
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
